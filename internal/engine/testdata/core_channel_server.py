"""The plugin's core channel server on a loop that steps every 5 ms, for
corechannel_test.go: python3 core_channel_server.py PLUGIN_DIR SOCKET TOKEN [--no-layout] [--no-round]"""

import sys
import threading
import time

sys.path.insert(0, sys.argv[1])

from vllm_hi_plugin.core_channel import Boundary, ChannelServer, Snapshot  # noqa: E402
from vllm_hi_plugin.wire import HookError  # noqa: E402

b = Boundary()
snap = Snapshot()
state = {"paused": []}


def pause(p):
    ids = p.get("request_ids") or []
    if "missing" in ids:
        raise HookError(404, "Request missing is not running here.", "request_ids")
    state["paused"] = ids
    out = {"paused": ids, "thread": threading.current_thread().name}
    if p.get("round_since") is not None and "round" in ops:
        # Read at the pause's boundary: cursor 11, where the round op says 9.
        out["round"] = ops["round"]({"since": p["round_since"]})
        out["round"]["requests"]["cursor"] = 11
    if p.get("export") is not None:
        out["exported"] = export({"request_ids": ids})
    return out


def resume(p):
    state["paused"] = []
    return {"resumed": p.get("request_ids") or []}


def export(p):
    return {"cursor": 7, "requests": [{"request_id": i, "via": "core channel"} for i in p.get("request_ids") or []]}


def install(p):
    ids = [r["request_id"] for r in p.get("requests") or []]
    if "taken" in ids:
        raise HookError(409, "Request taken has no reservation here.", "request_id")
    state["installed"] = state.get("installed", []) + ids
    return {"installed": ids}


ops = {"pause": pause, "resume": resume, "export": export, "install": install,
       "installed": lambda p: {"installed": state.get("installed", [])}}
if "--no-round" not in sys.argv:
    def round_inputs(p):
        out = {"layout": {"engine": "vllm", "model": "from-the-engine-core", "kv_generation": 3},
               "requests": {"cursor": 9, "requests": [{"request_id": "a", "block_ids": [4, 5]}]}}
        if p.get("since") is not None:
            out["changes"] = {"since": p["since"], "cursor": 9, "written": [{"block": 5, "first_slot": 2, "num_slots": 1, "request_id": "a"}]}
        return out
    ops["round"] = round_inputs
if "--no-layout" not in sys.argv:
    ops["layout"] = lambda p: {"engine": "vllm", "model": "from-the-engine-core", "served_model_names": ["from-the-engine-core"],
                               "kv_generation": 3}
srv = ChannelServer(sys.argv[2], sys.argv[3], b, ops, {"stats": lambda p, s: s}, snap)
srv.start()
print("ready", flush=True)
steps = 0
while True:
    b.begin_step()
    time.sleep(0.005)
    steps += 1
    b.end_step(lambda: snap.publish({"steps": steps, "paused": len(state["paused"])}))
