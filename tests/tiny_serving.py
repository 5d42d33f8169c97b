"""transformers' continuous batching on a tiny Llama from a config, each request with its own
``traceparent``, traced by the ``transformers.continuous_batching`` target: a serving workload
for tests that read its spans in another process (a backend, a trace file).

``python tiny_serving.py``: otel-gpu is configured by the environment (``OTEL_GPU_LOGLEVEL``,
``OTEL_GPU_LOGDEST``, the OTLP exporter's variables); the target and every module of the model
are instrumented here. The :data:`N` requests are queued before the manager's loop starts; a
step holds at most 3 requests and 8 tokens, so a request shares its steps with different
requests from step to step, and some steps serve one request alone.
"""

from __future__ import annotations

from typing import Any

N = 8
TRACEPARENTS = [f"00-{0xC000 + i:032x}-{0xD000 + i:016x}-01" for i in range(N)]
"""One W3C ``traceparent`` per request, in submission order (request ``req_i`` has the i-th)."""


def tiny_llama() -> Any:
    """A tiny Llama built from a config (2 layers, hidden size 32, vocabulary 128), seeded, in
    eval mode: no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def workload(
    n: int, *, new_tokens: int, batch_tokens: int, per_batch: int, lengths: int
) -> tuple[Any, Any, Any, list[list[int]]]:
    """The tiny Llama, a greedy generation of ``new_tokens`` that never stops early, batches of
    at most ``batch_tokens`` tokens and ``per_batch`` requests, and ``n`` prompts of 3 to
    ``2 + lengths`` tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_llama()
    generation = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    batching = ContinuousBatchingConfig(
        num_blocks=64,
        page_size=16,
        max_batch_tokens=batch_tokens,
        max_requests_per_batch=per_batch,
    )
    inputs = [[1 + (i * 7 + j) % 100 for j in range(3 + i % lengths)] for i in range(n)]
    return model, generation, batching, inputs


def run_queued(model: Any, generation: Any, batching: Any, inputs: Any, **kw: Any) -> Any:
    """Every request queued through the manager's ``add_requests`` (``kw`` passed on) before its
    loop starts, so the scheduler groups them the same way on every run; the finished outputs
    by request id, in submission order."""
    manager = model.init_continuous_batching(
        generation_config=generation, continuous_batching_config=batching
    )
    ids = manager.add_requests(inputs, **kw)
    manager.start()
    results: dict[str, Any] = {}
    try:
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, f"no result within 60 s; have {sorted(results)}"
            if result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    return {rid: results[rid] for rid in ids}


def main() -> None:
    from transformers.utils import logging

    import otel_gpu

    logging.set_verbosity_error()
    model, generation, batching, inputs = workload(
        N, new_tokens=4, batch_tokens=8, per_batch=3, lengths=4
    )

    assert otel_gpu.instrument("transformers.continuous_batching")
    otel_gpu.instrument_module(model)
    done = run_queued(model, generation, batching, inputs, traceparents=TRACEPARENTS)
    for result in done.values():
        assert result.error is None, result.error
    assert otel_gpu.flush(30.0)


if __name__ == "__main__":
    main()
