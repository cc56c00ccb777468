"""The exec session: a small server inside each sandbox, speaking JSON lines over stdin/stdout.

It serves the `Workspace` operations of a `LocalWorkspace` rooted at `/workspace` (baseline `/snapshot`), so
the tools run inside the sandbox exactly the code they run on a local directory — one implementation, two
transports. Requests are handled concurrently (parallel tool calls of one turn); each response carries its
request's id. Bytes travel base64-encoded. Errors come back typed (`PathError`, `OSError`, `Error`) with the
message meant for the model; the client re-raises them as the same exceptions.

Request:  {"id": 7, "method": "read_bytes", "params": {"path": "a.py"}}
Response: {"id": 7, "result": ...}  or  {"id": 7, "error": {"type": "PathError", "message": "..."}}

This module must import nothing outside the standard library and `shipyard.harness.{workspace,process}`:
inside the sandbox only the interpreter's stdlib and shipyard's own source are guaranteed.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shipyard.harness.process import Job
from shipyard.harness.workspace import LocalWorkspace, PathError


class Session:
    def __init__(self, root: str, baseline: str):
        self.ws = LocalWorkspace(root, baseline=baseline)
        self.jobs: dict[int, Job] = {}

    def call(self, method: str, p: dict[str, Any]) -> Any:
        ws = self.ws
        match method:
            case "ping":
                return "pong"
            case "environment":
                return ws.environment()
            case "resolve":
                return ws.resolve(p["path"])
            case "kind":
                return ws.kind(p["path"])
            case "read_bytes":
                return base64.b64encode(ws.read_bytes(p["path"])).decode()
            case "write_bytes":
                return ws.write_bytes(p["path"], base64.b64decode(p["data"]))
            case "delete":
                return ws.delete(p["path"])
            case "listdir":
                return [dataclasses.asdict(e) for e in ws.listdir(p["path"])]
            case "glob":
                return ws.glob(p["pattern"], p["path"])
            case "files":
                return ws.files(p["limit"])
            case "run":
                stdin = base64.b64decode(p["stdin"]) if p.get("stdin") is not None else None
                r = ws.run(p["argv"], timeout=p["timeout"], cwd=p.get("cwd"), env=p.get("env"), stdin=stdin)
                return {**dataclasses.asdict(r), "output": base64.b64encode(r.output).decode()}
            case "spawn":
                job = ws.spawn(p["command"], cwd=p["cwd"], env=p["env"])
                self.jobs[job.id] = job
                return {"id": job.id, "pid": job.pid, "log": job.log}
            case "job_running":
                return self.jobs[p["id"]].running()
            case "job_stop":
                return self.jobs[p["id"]].stop()
            case "diff":
                return ws.diff()
        raise ValueError(f"unknown method {method!r}")


def main(root: str = "/workspace", baseline: str = "/snapshot") -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints must never corrupt the protocol stream
    session = Session(root, baseline)
    lock = threading.Lock()

    def handle(req: dict[str, Any]) -> None:
        try:
            reply = {"id": req["id"], "result": session.call(req["method"], req.get("params", {}))}
        except PathError as e:
            reply = {"id": req["id"], "error": {"type": "PathError", "message": str(e)}}
        except OSError as e:
            reply = {"id": req["id"], "error": {"type": "OSError", "errno": e.errno, "message": str(e)}}
        except Exception as e:  # a bug here must reach the caller, not kill the session
            reply = {"id": req["id"], "error": {"type": "Error", "message": f"{type(e).__name__}: {e}"}}
        data = json.dumps(reply).encode() + b"\n"
        with lock:
            out.write(data)

    with ThreadPoolExecutor(max_workers=64) as pool:
        for line in sys.stdin.buffer:
            if line.strip():
                pool.submit(handle, json.loads(line))
    session.ws.close()


if __name__ == "__main__":
    main()
