"""vllm-hi's plugin for vLLM: the engine hooks a `vhi agent` drives.

`plugin.register` (a `vllm.general_plugins` entry point) runs in every vLLM
process; `endpoints.VhiEndpoints` (a `vllm.endpoint_plugins` entry point)
adds the `/vllm_hi/engine/*` routes to the API server. docs/engine-hooks.md
maps each hook to the vLLM internals used here.
"""

__version__ = "0.1.0"
HOOKS_VERSION = 1
# vLLM versions whose internals this plugin was written against and tested
# with; others are refused at start-up with a clear message.
SUPPORTED_VLLM = ("0.26.", "0.32.")
