"""OpenAI-compatible HTTP server and Prometheus metrics: a separate process, an IPC client of rlt-serve.

`rlt-serve --http-port PORT` starts it (process.HttpProcess); app.build_app is the FastAPI app.
"""
