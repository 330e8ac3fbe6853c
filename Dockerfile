# CPU image of every Banyan service (the demo model needs no GPU). The GPU image and the verified
# compose stack come with the deployment issue.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY banyan banyan
COPY services services
COPY shared shared
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir .
ENV BANYAN_CACHE_DIR=/cache PYTHONUNBUFFERED=1
VOLUME /cache
