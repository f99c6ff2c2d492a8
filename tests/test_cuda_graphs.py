"""CUDA graphs of decode and chain-verification steps (:mod:`specdec.compilation.cuda_graphs`).

On the CPU the runner lays steps out on its padded grid without capturing (``capture=False``): the real
rows must equal the unpadded forward (float32, the reference attention), so padding rows, padding
requests and the row gather are proven without a GPU. On CUDA (skipped elsewhere) the captured graphs
must give the eager forward's greedy tokens and logits within bf16 rounding, and the engine's greedy
output with graphs must equal the output without them.
"""

from __future__ import annotations

import pytest
import torch

from specdec.compilation.cuda_graphs import CudaGraphRunner
from specdec.config import CompilationConfig
from specdec.errors import ConfigError
from specdec.model_runner import ModelRunner, Segment, build_inputs
from specdec.models.config import ModelArchConfig
from specdec.models.decoder import DecoderLM

BS = 4


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> DecoderLM:
    from tests.conftest import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", heads=4, kv_heads=2, tie=False, vocab_size=96, seed=3)
    model = DecoderLM(ModelArchConfig.from_hf_config(hf.config)).eval()
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.to(device=device, dtype=dtype)


def _segments(
    query_lens: list[int], ctx: list[int], blocks_per_req: int, gen: torch.Generator
) -> list[Segment]:
    """Requests with ``ctx[b]`` tokens of K/V already written and ``query_lens[b]`` new tokens, each
    owning its own blocks; every row's logits wanted (decode and chain verification)."""
    segs = []
    for b, (q, c) in enumerate(zip(query_lens, ctx, strict=True)):
        blocks = list(range(1 + b * blocks_per_req, 1 + (b + 1) * blocks_per_req))
        tokens = torch.randint(3, 96, (q,), generator=gen).tolist()
        segs.append(Segment(blocks, c, tokens, q, num_drafts=q - 1))
    return segs


def _prefill(runner: ModelRunner, query_lens: list[int], ctx: list[int], gen: torch.Generator) -> None:
    """Write each request's context K/V with an eager prefill."""
    segs = [
        Segment(s.block_ids, 0, torch.randint(3, 96, (c,), generator=gen).tolist(), 1)
        for s, c in zip(_segments(query_lens, ctx, 8, gen), ctx, strict=True)
    ]
    runner.execute(build_inputs(segs, BS, runner.device))


@pytest.mark.parametrize(
    ("query_lens", "ctx", "sizes"),
    [
        ([1, 1, 1], [5, 9, 2], (1, 2, 4)),  # decode, padded 3 -> 4 requests
        ([1, 3, 5], [7, 1, 12], (4,)),  # chains of different lengths: padding rows inside requests
        ([5], [20], (1, 2)),  # one request, no padding request
    ],
)
def test_padded_grid_equals_the_unpadded_forward(query_lens, ctx, sizes):
    gen = torch.Generator().manual_seed(7)
    model = tiny_model()
    runner = ModelRunner(model, num_blocks=1 + 8 * len(query_lens), block_size=BS, attention="reference")
    _prefill(runner, query_lens, ctx, gen)
    graphs = CudaGraphRunner(
        model, runner.kv_caches, runner.attention, model.cfg.num_heads, model.cfg.num_kv_heads,
        num_blocks=1 + 8 * len(query_lens), batch_sizes=sizes, max_query_len=8, capture=False,
    )  # fmt: skip
    inputs = build_inputs(_segments(query_lens, ctx, 8, gen), BS, runner.device)
    k_before = [k.clone() for k, _ in runner.kv_caches]
    for all_hidden in (False, True):
        out = graphs.run(
            inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, all_hidden
        )
        assert out is not None
        ref = model(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata, runner.attention,
            inputs.logits_indices, all_hidden,
        )  # fmt: skip
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
        assert out[0].argmax(-1).tolist() == ref[0].argmax(-1).tolist()
    assert graphs.stats.graph_calls == 2 and graphs.stats.eager_calls == 0
    # Padding rows write no K/V: only the real tokens' slots changed (both forwards wrote the same values).
    written = {int(s) for s in inputs.metadata.slot_mapping}
    for (k, _), before in zip(runner.kv_caches, k_before, strict=True):
        flat, flat_before = k.flatten(0, 1), before.flatten(0, 1)
        changed = {i for i in range(flat.shape[0]) if not torch.equal(flat[i], flat_before[i])}
        assert changed <= written


def test_steps_that_do_not_qualify_run_eagerly():
    gen = torch.Generator().manual_seed(1)
    model = tiny_model()
    runner = ModelRunner(model, num_blocks=40, block_size=BS, attention="reference")
    graphs = CudaGraphRunner(
        model, runner.kv_caches, runner.attention, model.cfg.num_heads, model.cfg.num_kv_heads,
        num_blocks=40, batch_sizes=(1, 2), max_query_len=4, capture=False,
    )  # fmt: skip
    cases = {
        "query longer than max_query_len": _segments([5], [3], 8, gen),
        "more requests than the largest size": _segments([1, 1, 1], [3, 3, 3], 8, gen),
    }
    tree = _segments([3], [4], 8, gen)
    tree[0].mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    cases["a token tree"] = tree
    for name, segs in cases.items():
        inputs = build_inputs(segs, BS, runner.device)
        out = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, False)
        assert out is None, name
    assert graphs.stats.eager_calls == 3 and graphs.stats.graph_calls == 0


def test_bad_cuda_graph_settings_are_config_errors():
    for bad in (
        {"cuda_graphs": "yes"},
        {"cuda_graphs": True, "cuda_graph_batch_sizes": [0, 2]},
        {"cuda_graphs": True, "cuda_graph_max_query_len": 0},
    ):
        with pytest.raises(ConfigError, match="cuda_graph"):
            CompilationConfig.from_any(bad)
    with pytest.raises(ConfigError, match="at most 1024"):
        CompilationConfig.from_any({"cuda_graphs": True, "cuda_graph_batch_sizes": [1, 4096]})
    assert CompilationConfig.from_any({"enabled": False, "cuda_graphs": True}) is not None
    # Checked before any loading (LLM): a CUDA device whose attention backend would not be Triton.
    from specdec.compilation.cuda_graphs import check_cuda_graphs

    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        check_cuda_graphs(torch.device("cuda"), "int8")
    with pytest.raises(ConfigError, match="CUDA device"):
        check_cuda_graphs(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA device"):
            ModelRunner(tiny_model(), 8, BS, compilation=CompilationConfig(enabled=False, cuda_graphs=True))
    model = tiny_model()
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphRunner(model, ModelRunner(model, 8, BS).kv_caches, object(), 4, 2, 8)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_replay_the_eager_forward_on_cuda():
    model = tiny_model("cuda", torch.bfloat16)
    eager = ModelRunner(model, 64, BS, attention="triton")
    graphed = ModelRunner(
        model, 64, BS, attention="triton", compilation=CompilationConfig(enabled=False, cuda_graphs=True)
    )
    for seed, (query_lens, ctx) in enumerate(
        (([1, 1, 1], [5, 9, 2]), ([1, 3, 5], [7, 1, 12]), ([2, 2], [30, 3]))
    ):
        g = torch.Generator().manual_seed(seed)
        for runner in (eager, graphed):
            _prefill(runner, query_lens, ctx, torch.Generator().manual_seed(3))
        segs = _segments(query_lens, ctx, 8, g)
        ref = eager.execute_with_hidden(build_inputs(segs, BS, eager.device))
        out = graphed.execute_with_hidden(build_inputs(segs, BS, graphed.device))
        assert out[0].argmax(-1).tolist() == ref[0].argmax(-1).tolist()
        torch.testing.assert_close(out[0], ref[0], rtol=2e-2, atol=2e-2)
    stats = graphed.cuda_graph_stats
    assert stats is not None and stats.graph_calls >= 3 and len(stats.captured) >= 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_llm_with_cuda_graphs_on_the_cpu_fails_before_loading(tiny_model_dirs):
    from specdec import LLM

    with pytest.raises(ConfigError, match="CUDA device"):
        LLM(tiny_model_dirs["llama-mha-untied"], device="cpu", skip_tokenizer_init=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs must be a bool"):
        LLM(tiny_model_dirs["llama-mha-untied"], device="cpu", skip_tokenizer_init=True, cuda_graphs="on")  # type: ignore[arg-type]


def test_hydra_engine_group_and_cli_pass_cuda_graphs():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config
    from specdec.cli import build_parser

    register_configs()
    with initialize_config_module("experiments.conf", version_base=None):
        cfg = to_experiment_config(compose(config_name="config"))
        assert cfg.engine.llm_kwargs(cfg.model)["cuda_graphs"] is False  # eager by default
        cfg = to_experiment_config(compose(config_name="config", overrides=["engine.cuda_graphs=true"]))
        assert cfg.engine.llm_kwargs(cfg.model)["cuda_graphs"] is True
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "hi", "--cuda-graphs"]).cuda_graphs is True
    assert parser.parse_args(["generate", "--prompt", "hi"]).cuda_graphs is False


def test_the_grid_over_a_compiled_forward_equals_the_eager_forward():
    """``compile`` and ``cuda_graphs`` together: the grid's padded batch goes through the compiled forward
    (padded again to its token bucket), and the real rows still equal the unpadded eager forward."""
    from specdec.compilation.compiled_model import CompiledDecoder

    gen = torch.Generator().manual_seed(9)
    query_lens, ctx = [1, 3], [6, 10]
    model = tiny_model()
    runner = ModelRunner(model, num_blocks=17, block_size=BS, attention="reference")
    _prefill(runner, query_lens, ctx, gen)
    compiled = CompiledDecoder(model, (4, 16), backend="eager")
    graphs = CudaGraphRunner(
        compiled, runner.kv_caches, runner.attention, model.cfg.num_heads, model.cfg.num_kv_heads,
        num_blocks=17, batch_sizes=(2, 4), max_query_len=4, capture=False,
    )  # fmt: skip
    inputs = build_inputs(_segments(query_lens, ctx, 8, gen), BS, runner.device)
    out = graphs.run(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices, False)
    assert out is not None and compiled.stats.compiled_calls == 1  # 2 x 3 grid rows -> the 16 bucket
    ref = model(
        inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata, runner.attention,
        inputs.logits_indices,
    )  # fmt: skip
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
