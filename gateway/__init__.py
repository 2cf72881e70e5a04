"""OpenAI-compatible HTTP gateway of the meshserve mesh.

Translates the OpenAI / vLLM REST API (FastAPI + uvicorn) into gRPC calls to the
tokenizer and scheduler services. Entry point: `python -m gateway`.
"""
