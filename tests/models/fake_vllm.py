"""A fake vLLM server for tests: the routes `shipyard.models.vllm.VLLMEngine` and `VLLMServers` use, served for real
(uvicorn), answering as vLLM 0.32 does — and, told so, as a broken or hostile server would.

`FakeVLLM().app` is an ASGI app: run it in-process (`servers.running_app`) to attack the client, or run this file
as vLLM's `python` (`python fake_vllm.py -m vllm.entrypoints.openai.api_server … --uds SOCKET`: the launcher's own
command line, through a wrapper script) to attack the launcher. It imports nothing of shipyard and no torch.

Generation: `max_tokens` tokens, ids counting up from the prompt's last, logprob -0.5 each, one weight-version span
of the current version. A request registered as `generate-tokens-<request_id>` that is aborted ends "abort".
`misbehave[path] = async fn(body) -> Response | None` replaces a route's answer (None: answer normally).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

Misbehaviour = Callable[[dict], Awaitable[Response | None]]


class FakeVLLM:
    def __init__(self, model: str = "fake-model", owned_by: str = "vllm"):
        self.model, self.owned_by = model, owned_by
        self.misbehave: dict[str, Misbehaviour] = {}
        self.calls: list[tuple[str, dict]] = []  # (path, body or query) of every call but /health
        self.version = "0"
        self.paused = False
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.released = threading.Event()  # set at teardown: every hanging handler returns
        self.healthy = True
        self.extra: dict = {}  # answered by GET /fake/info
        self.lora_rank = 0  # --max-lora-rank, as the worker extension reports it (0: started without --enable-lora)
        self.transfer = ""  # --weight-transfer-config's backend, as the worker extension reports it
        self.peer = None  # the workers' end of an NCCL push (tests/models/fake_nccl.TransferPeer); None: no transfer
        self.core = asyncio.Lock()  # vLLM's engine core answers its control calls one at a time: a stuck transfer
        # holds up the resume after it
        self.app = self._build()

    def reset(self) -> None:
        self.misbehave.clear()
        self.calls.clear()
        self.version, self.paused, self.healthy, self.lora_rank, self.transfer = "0", False, True, 0, ""
        self.peer = None
        self.core = asyncio.Lock()  # a handler an earlier test left hanging holds the old one
        self.aborted.clear()
        self.running.clear()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    async def hang(self) -> None:
        """Until the test ends (`released`): a server that never answers."""
        while not self.released.is_set():
            await asyncio.sleep(0.02)

    def generation(self, body: dict, n: int | None = None, finish: str = "length") -> dict:
        prompt = body.get("token_ids") or [0]
        n = body["sampling_params"]["max_tokens"] if n is None else n
        ids = [(prompt[-1] + 1 + i) % 250 for i in range(n)]
        return {"request_id": body.get("request_id"), "choices": [{
            "index": 0, "token_ids": ids, "finish_reason": finish,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5} for t in ids]},
            "weight_versions": [{"version": self.version, "start": 0, "end": n}]}]}

    def _build(self) -> FastAPI:
        app = FastAPI()
        fake = self

        async def answer(path: str, body: dict, normal: Callable[[], Awaitable[object] | object]) -> Response:
            fake.calls.append((path, body))
            if path in fake.misbehave:
                out = await fake.misbehave[path](body)
                if out is not None:
                    return out
            result = normal()
            if asyncio.iscoroutine(result):
                result = await result
            return result if isinstance(result, Response) else JSONResponse(result)

        @app.get("/health")
        async def health():
            return Response(status_code=200 if fake.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return await answer("/v1/models", {}, lambda: {"object": "list", "data": [
                {"id": fake.model, "object": "model", "owned_by": fake.owned_by}]})

        @app.get("/is_paused")
        async def is_paused():
            return await answer("/is_paused", {}, lambda: {"is_paused": fake.paused})

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            body = await request.json()

            async def normal():
                rid = f"generate-tokens-{body.get('request_id')}"
                fake.running.add(rid)
                try:
                    if body["sampling_params"]["max_tokens"] >= 1000:  # long: generates until aborted
                        while rid not in fake.aborted and not fake.released.is_set():
                            await asyncio.sleep(0.02)
                        return fake.generation(body, n=3, finish="abort")
                    return fake.generation(body)
                finally:
                    fake.running.discard(rid)

            return await answer("/inference/v1/generate", body, normal)

        @app.post("/inference/v1/abort_requests")
        async def abort(request: Request):
            body = await request.json()
            return await answer("/inference/v1/abort_requests", body,
                                lambda: fake.aborted.update(body["request_ids"]) or {})

        @app.post("/pause")
        async def pause(mode: str = "abort"):
            def normal():
                fake.paused = True
                return {}
            return await answer("/pause", {"mode": mode}, normal)

        @app.post("/resume")
        async def resume():
            def normal():
                fake.paused = False
                return {}
            async with fake.core:
                return await answer("/resume", {}, normal)

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            body = await request.json()

            def normal():
                if body.get("method") == "shipyard_ready" and not os.environ.get("FAKE_VLLM_NO_EXTENSION"):
                    return {"results": ["ready"]}
                if body.get("method") == "shipyard_lora_rank":
                    return {"results": [str(fake.lora_rank)]}  # vLLM's route answers a scalar as a string
                if body.get("method") == "shipyard_transfer":
                    return {"results": [fake.transfer]}
                if body.get("method") == "shipyard_retie":
                    return {"results": ["untied"]}
                if body.get("method") != "shipyard_reload":
                    return JSONResponse({"error": f"no method {body.get('method')}"}, status_code=500)
                ok = (Path(body["args"][0]) / "model.safetensors").is_file()
                return {"results": ["untied" if ok else "error: no model.safetensors"]}

            return await answer("/collective_rpc", body, normal)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):  # with VLLM_ALLOW_RUNTIME_LORA_UPDATING, with or without LoRA
            body = await request.json()
            return await answer("/v1/load_lora_adapter", body, lambda: JSONResponse(
                {"error": {"message": "lora_name and lora_path are required"}}, status_code=400))

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await request.json()

            def normal():
                fake.version = body["new_version"]
                return {}

            return await answer("/update_weight_version", body, normal)

        def transfer_route(path: str, work: Callable[[object, dict], object] | None):
            """A weight-transfer route: `work(peer, body)` on a thread (it may wait for the trainer), then {}."""
            @app.post(path)
            async def route(request: Request):
                body = await request.json() if await request.body() else {}

                async def normal():
                    if fake.peer is None:
                        return JSONResponse({"error": "weight transfer is not configured"}, status_code=500)
                    if work is not None:
                        await asyncio.to_thread(work, fake.peer, body)
                    return {}

                async with fake.core:
                    return await answer(path, body, normal)

        transfer_route("/init_weight_transfer_engine", lambda peer, body: peer.init(body))
        transfer_route("/update_weights", lambda peer, body: peer.receive(body))
        for path in ("/start_weight_update", "/finish_weight_update", "/shutdown_weight_transfer_engine"):
            transfer_route(path, None)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            return await answer("/reset_prefix_cache", {}, lambda: {})

        @app.get("/fake/info")
        async def info():
            return {"pythonpath": os.environ.get("PYTHONPATH"), "argv": sys.argv, "pid": os.getpid(),
                    "pgid": os.getpgid(0), "sys_path": sys.path, **fake.extra}

        return app


def serve_as_vllm(argv: list[str]) -> None:
    """This file run as vLLM's python by `VLLMServers`: the fake on `--uds`, with a child in its process group that
    ignores SIGTERM (as an engine core that hangs would). $FAKE_VLLM: "exit" (dies while starting), "sick" (never
    healthy)."""
    import uvicorn

    mode = os.environ.get("FAKE_VLLM", "")
    if mode == "exit":
        print("fake vllm: CUDA out of memory while loading the model", flush=True)
        sys.exit(3)
    socket = argv[argv.index("--uds") + 1]
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('child up', flush=True)\nwhile True: signal.pause()"])
    fake = FakeVLLM(model=argv[argv.index("--model") + 1])
    fake.healthy = mode != "sick"
    try:
        import shipyard_vllm_worker  # from the launcher's PYTHONPATH only
        worker = shipyard_vllm_worker.__file__
    except ImportError as e:
        worker = f"not importable: {e}"
    fake.extra = {"child": child.pid, "worker": worker}
    print(f"fake vllm on {socket}, child pid {child.pid}: {json.dumps(argv)}", flush=True)
    uvicorn.run(fake.app, uds=socket, log_level="warning")


if __name__ == "__main__":
    serve_as_vllm(sys.argv[1:])
