"""Code that runs inside the vLLM server (vLLM's own environment), put on its PYTHONPATH by ``engines/vllm_server.py``;
the project never imports it. A package only so that an install ships it."""
