"""``/docs``: Swagger UI over ``/openapi.json``, its JavaScript, CSS and icon served by the replica
itself from the ``fastapi-offline`` package (a pinned Swagger UI 5 build, as FastAPI's default
page would load from a CDN): the page works on a machine without internet access, and nothing
reaches out when it is opened (the online spec validator is off too)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

DOCS = "/docs"
ASSETS = "/docs/assets"  # swagger-ui-bundle.js, swagger-ui.css, favicon.png
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def install_docs(app: FastAPI) -> None:
    """Add ``/docs`` to an app built with ``docs_url=None``."""
    app.mount(ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    @app.get(DOCS, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon.png", oauth2_redirect_url=OAUTH2_REDIRECT,
                                   swagger_ui_parameters={"validatorUrl": None})

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
