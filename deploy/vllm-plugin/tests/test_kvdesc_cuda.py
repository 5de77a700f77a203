"""The CUDA IPC export (kvdesc.cuda_ipc_memory) on a real GPU: another
process opens the handle with the driver API, adds the offset, and reads
the very bytes torch wrote. Skipped where torch with CUDA is absent (CI);
the GPU machines run it: python3 -m unittest discover deploy/vllm-plugin/tests"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin.kvdesc import cuda_ipc_memory  # noqa: E402

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    HAVE_CUDA = False

# The reader: a process of its own (CUDA refuses to open a process's own
# IPC handles), the driver API only, as the Go agent uses it.
READER = r"""
import base64, ctypes, hashlib, json, sys
mem, n = json.loads(sys.argv[1]), int(sys.argv[2])
cu = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: CUresult {rc}")
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
ok(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(cu.cuDeviceGet(ctypes.byref(dev), mem["device"]), "cuDeviceGet")
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
h = Handle()
ctypes.memmove(ctypes.byref(h), base64.b64decode(mem["ipc_handle"]), 64)
ptr = ctypes.c_uint64()
open_ = getattr(cu, "cuIpcOpenMemHandle_v2", None) or cu.cuIpcOpenMemHandle
open_.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
ok(open_(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")
buf = ctypes.create_string_buffer(n)
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
ok(cu.cuMemcpyDtoH_v2(buf, ptr.value + mem["offset"], n), "cuMemcpyDtoH")
print(hashlib.sha256(buf.raw).hexdigest())
"""


@unittest.skipUnless(HAVE_CUDA, "no CUDA device here (torch with CUDA): the GPU machines run this")
class CudaIPCExportTest(unittest.TestCase):
    def test_another_process_reads_the_bytes_through_the_handle(self):
        backing = torch.zeros(64 << 20, dtype=torch.int8, device="cuda:0")
        view = backing[3 * 4096 + 512:]  # a layer that does not start the allocation
        n = 1 << 20
        view[:n] = (torch.arange(n, device="cuda:0") % 251 - 125).to(torch.int8)
        torch.cuda.synchronize()
        mem = cuda_ipc_memory(view.data_ptr(), 0)
        smi = shutil.which("nvidia-smi")
        if smi:  # the same name NVML gives the GPU
            uuids = subprocess.run([smi, "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=60).stdout.split()
            self.assertIn(mem["device_uuid"], uuids)
        self.assertEqual(mem["device_pointer"] + mem["offset"], view.data_ptr())
        self.assertEqual(mem["offset"] % 512, 0)
        want = hashlib.sha256(view[:n].cpu().numpy().tobytes()).hexdigest()
        got = subprocess.run([sys.executable, "-c", READER, json.dumps(mem), str(n)], capture_output=True, text=True,
                             timeout=60)
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertEqual(got.stdout.strip(), want)


if __name__ == "__main__":
    unittest.main()
