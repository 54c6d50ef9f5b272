"""`FusedMoE` with the Triton kernels on a CUDA GPU at gpt-oss-20b layer size (E=32, K=4, H=I=2880).

Data flow per test:
1. HF parity: a one-layer HF GPT-OSS model of gpt-oss-20b layer size in bf16 on the GPU -> logits and the
   MoE block's output -> `patch_model` (Triton, bf16 weights, INTERLEAVED, biases) -> the same again, and
   both against an fp32 reference of the block on the same routing.
2. CUDA graphs: a synthetic MXFP4 gpt-oss-20b layer written as a checkpoint -> `from_gpt_oss_checkpoint` ->
   `warmup(256)` -> eager forwards with sync debugging set to error (no host sync) -> one graph captured
   per token count (1, 37, 200), replayed on new inputs, equal to eager; no Triton compile during capture.
3. torch.compile(fullgraph=True, dynamic=True) of a function holding the layer, against eager, at three
   token counts (three buckets) with one compiled graph per call signature.

Run in its own pytest process (the interpreter tests set TRITON_INTERPRET=1 for theirs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_only import skip_unless_compiled_gpu, triton_compiles

skip_unless_compiled_gpu()

from test_triton_gpu import peak_bytes  # noqa: E402

from moekit import fused_moe_reference, preset, route  # noqa: E402
from moekit.checkpoint import CheckpointNaming, GptOssLayer, save_gpt_oss_layer  # noqa: E402
from moekit.layer import FusedMoE  # noqa: E402
from moekit.reference import relative_l2_error  # noqa: E402
from moekit.synthetic import random_layer  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", torch.cuda.current_device())
SPEC_20B = preset("gpt-oss-20b")  # MXFP4, bf16 activations, SWIGLU_OAI 1.702 / 7, INTERLEAVED, biases
GRAPH_TOKENS = (1, 37, 200)  # decode, a ragged prefill, a larger batch: three buckets


@pytest.fixture(scope="module")
def mxfp4_layer(tmp_path_factory) -> FusedMoE:
    layer = random_layer(SPEC_20B, seed=0, device=DEVICE)
    bias = (0.1 * torch.randn(SPEC_20B.E, device=DEVICE)).to(torch.bfloat16)
    saved = GptOssLayer(
        weights=layer.weights,
        router_weight=layer.router_weight,
        router_bias=bias,
        naming=CheckpointNaming.HF,
        layer=0,
    )
    path = save_gpt_oss_layer(
        tmp_path_factory.mktemp("ckpt") / "model.safetensors", saved, layer=0, naming=CheckpointNaming.HF
    )
    moe = FusedMoE.from_gpt_oss_checkpoint(path, 0, device=DEVICE)
    assert moe.plans[1].kernel == "triton_fused"
    return moe


def _reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(x.float(), moe.router_weight.float(), moe.router_bias.float())
    routing = route(logits, top_k=moe.spec.K, spec=moe.spec.routing)
    return fused_moe_reference(x, moe.weights, routing, spec=moe.spec)


def test_patched_hf_gpt_oss_20b_layer_matches_unpatched() -> None:
    transformers = pytest.importorskip("transformers")
    from moekit.integrations.transformers import patch_model, unpatch

    config = transformers.GptOssConfig(
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=1,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=2048,
        layer_types=["full_attention"],
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():  # HF initializes expert biases to zero; real checkpoints have them
        block.experts.gate_up_proj_bias.normal_(0.0, 0.05)
        block.experts.down_proj_bias.normal_(0.0, 0.05)
    ids = torch.randint(0, config.vocab_size, (2, 150), device=DEVICE)
    hidden = torch.randn(1, 300, config.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        expected_logits = model(ids).logits.float()
        expected_block = block(hidden)[0]
        router_logits = block.router(hidden[0])[0]
    report = patch_model(model)
    assert [b.kernel for b in report.blocks] == ["triton_fused"]
    patched = model.model.layers[0].mlp
    with torch.no_grad():
        got_block = patched(hidden)[0]
        got_logits = model(ids).logits.float()
    # fp32 reference of the block on the routing both paths use (the HF router's bf16 logits).
    moe = patched.moe
    routing = route(router_logits, top_k=4, spec=moe.spec.routing)
    fp32_spec = replace(moe.spec, act_dtype=torch.float32)
    ref = fused_moe_reference(hidden[0].float(), moe.weights, routing, spec=fp32_spec)
    err_hf, err_moekit = relative_l2_error(expected_block[0], ref), relative_l2_error(got_block[0], ref)
    err_logits = relative_l2_error(got_logits, expected_logits)
    print(
        f"\nblock vs fp32 reference: HF {err_hf:.2e}, moekit {err_moekit:.2e}; "
        f"logits moekit vs HF {err_logits:.2e}"
    )
    assert err_moekit <= max(2 * err_hf, 1e-2)
    assert relative_l2_error(got_block, expected_block) < 2e-2
    assert err_logits < 2e-2
    unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), expected_logits, rtol=1e-3, atol=1e-3)


def test_cuda_graph_replay_at_three_token_counts(mxfp4_layer: FusedMoE) -> None:
    moe = mxfp4_layer
    with triton_compiles() as in_warmup:
        report = moe.warmup(max(GRAPH_TOKENS))
    assert {p.kernel for p in report.plans} == {"triton_fused"}
    # The first MXFP4 layer of this process: its warmup must add kernels, or the count below proves nothing.
    assert in_warmup, "warmup compiled no Triton kernel: the compile count cannot see compilations"
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    with triton_compiles() as after_warmup:
        _serve_and_replay(moe, gen)
    assert not after_warmup, f"Triton kernels compiled after warmup: {after_warmup}"


def _serve_and_replay(moe: FusedMoE, gen: torch.Generator) -> None:
    """At each of GRAPH_TOKENS: an eager forward without host syncs, equal to the reference, then a
    CUDA graph captured and replayed on new inputs, equal to eager."""
    for t in GRAPH_TOKENS:
        static_x = torch.randn(t, SPEC_20B.H, generator=gen, device=DEVICE).to(torch.bfloat16)
        with torch.no_grad():
            moe.check_values = False  # the finite-logits check reads one bool (a sync); servers turn it off
            moe.count_tokens_per_expert = True  # must not sync either
            torch.cuda.set_sync_debug_mode("error")  # any host synchronization in the forward raises
            try:
                eager = moe(static_x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                moe.check_values = True
                moe.count_tokens_per_expert = False
            assert int(moe.tokens_per_expert.sum()) == t * SPEC_20B.K
            assert relative_l2_error(eager, _reference(moe, static_x)) < 1e-2
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                moe(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = moe(static_x)
            for seed in (2, 3):
                new_x = torch.randn(t, SPEC_20B.H, generator=gen.manual_seed(seed), device=DEVICE)
                static_x.copy_(new_x.to(torch.bfloat16))
                graph.replay()
                torch.cuda.synchronize()
                torch.testing.assert_close(static_out, moe(static_x), rtol=0, atol=0)


def test_workspace_bytes_bounds_the_measured_peak(mxfp4_layer: FusedMoE) -> None:
    moe = mxfp4_layer
    x = torch.randn(512, SPEC_20B.H, device=DEVICE).to(torch.bfloat16)
    with torch.no_grad():
        out, peak = peak_bytes(lambda: moe(x))
    predicted = moe.workspace_bytes(512)
    print(f"\nworkspace at T=512: predicted {predicted / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB")
    assert out.shape == x.shape and 0.5 * predicted <= peak <= 1.5 * predicted


def test_torch_compile_fullgraph_on_gpu(mxfp4_layer: FusedMoE) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    moe = mxfp4_layer
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # the op's (x, logits, out), in order
    run_flat = moe.run_flat

    def recording_run_flat(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out = run_flat(x, logits)
        calls.append((x.clone(), logits.clone(), out.clone()))
        return out

    def block(hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        return 2 * hidden + moe(hidden, router_logits=logits)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    moe.run_flat = recording_run_flat
    try:
        with torch.no_grad():
            for t in (5, 37, 200):  # three buckets, one graph
                x = torch.randn(t, SPEC_20B.H, generator=gen, device=DEVICE).to(torch.bfloat16)
                logits = torch.randn(t, SPEC_20B.E, generator=gen, device=DEVICE)
                calls.clear()
                got, want, again = compiled(x, logits), block(x, logits), block(x, logits)
                # Same tokens and logits reach the same kernels: equal to the last bit. When not, say at
                # which stage they part: the eager layer itself, the op's inputs, its output, the add.
                if not torch.equal(got, want):
                    (xc, lc, oc), (xe, le, oe) = calls[0], calls[1]
                    raise AssertionError(
                        f"T={t}: compiled != eager in {_differ(got, want)} of the elements; eager vs eager "
                        f"{_differ(want, again)}; op inputs equal x {torch.equal(xc, xe)} logits "
                        f"{torch.equal(lc, le)}; op outputs differ in {_differ(oc, oe)}; compiled vs "
                        f"2 * x + its op output {_differ(got, 2 * x + oc)}; plan "
                        f"{moe.plan_for(t).config.as_dict()}"
                    )
                # The layer's own fp32 router inside the graph (a fused bias add may round differently in
                # the last fp32 bit, which could only flip an exact routing tie).
                assert relative_l2_error(compiled(x, None), block(x, None)) < 1e-3
    finally:
        del moe.run_flat
    assert counter.frame_count == 2  # one graph with given logits, one with the layer's router


def _differ(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a != b).float().mean().item():.1%}"
