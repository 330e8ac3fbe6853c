"""Code shared by every Banyan service: config, wire messages + codec, ZMQ queues, logging.

No process logic lives here.
"""
