"""SGLang 0.5.23's own DeepSeek DSA attention layer on CPU with nsa-backend's SGLang backend.

Each case builds SGLang's ``DeepseekV2AttentionMLA`` (DSA handler, ``forward_mla.py``, the DSA
``Indexer``) with a tiny random config, SGLang's ``DSATokenToKVPool`` (row size from SGLang's KV-cache
configurator) and ``ReqToTokenPool``, publishes the server arguments a launch resolves for the case
(``sglang_layer_support.launch_server``: SGLang's ``prepare_server_args``, ``ServerArgs.resolve_once()``
with the plugin's resolution hook in effect and the simulated GPU's capability, then
``check_server_args`` as the plugin wraps it, on a ``config.json`` of the tiny model) and gets the
backend from SGLang's registry after the plugin's real ``register()`` (``--attention-backend
nsa_backend``, or the ``dsa`` name served under takeover). It then runs one request pair through five
batches, each checked against a plain-torch reference computed from the layer's weights and inputs
(projections, DeepSeek YaRN RoPE, absorbed MLA, the indexer's fp8 logits and top-k, sparse softmax
attention, ``o_proj``): a prefill, a prefill over a cached prefix (one request past ``index_topk``
keys, so top-k drops keys; the other below it), a decode step, an MTP target verify and an MTP draft
extend (``DRAFT_EXTEND_V2``).

Matrix: by name (``nsa_backend``) and under takeover (``dsa``), DeepSeek-V3.2 and GLM-5, each GPU
SGLang's resolution tells apart (sm90, sm100, sm120, simulated; nsa-backend validates its choice for
it through ``NSA_BACKEND_FORCE_ARCH``), the default and the other cache dtype; each case asserts the
resolved cache dtype and phase kernels. With no ``--dsa-*-backend`` flag, SGLang's ``trtllm`` phases
with an FP8 cache (V3.2 on sm100 / sm120, GLM-5 on sm100) are resolved to ``flashmla_sparse`` /
``flashmla_kv`` by the plugin's hook, so those launches allocate the scaled 656-byte rows and run.
``--dsa-prefill-backend trtllm --dsa-decode-backend trtllm`` with FP8 runs SGLang's own TRT-LLM
attention on its raw rows (no CPU path): the case checks that the backend builds on SGLang's raw pool
with no phase on nsa-backend's ops. A ``trtllm`` typed for one phase while nsa-backend runs the other
is refused when the server starts. Fused RoPE (``forward_mla.py``'s ``_fuse_rope_for_trtllm_mla``: a
``dsa`` / ``nsa`` backend, a phase resolved to ``trtllm``, an FP8 cache; the model then skips RoPE on
q_pe / k_pe and passes ``cos_sin_cache`` / ``is_neox``) over a cache nsa-backend reads happens on a
PD-disaggregated decode worker (``--disaggregation-mode decode --dsa-decode-backend flashmla_kv``: the
pool is sized from the decode choice, the prefill phase still resolves to ``trtllm``, which the hook
leaves since it does not size the pool); those cases run the prompts on a prefill worker sharing the
pools (the transferred KV cache), then decode / verify / draft extend on the decode worker.

A typed FlashMLA / FlashInfer choice selects GPU kernels; on CPU tensors the same backend path runs
nsa-backend's ``auto`` route (``CHOICE_TO_IMPL`` mapped to ``auto`` for the test).

SGLang ops replaced because they have no CPU path (``sglang_layer_support.cpu_replacements``):

- ``layers.rotary_embedding.base._is_cpu = True`` (the CPU rope path; otherwise vLLM's op is imported)
  and the rope cache kept in fp32 (``SGLANG_ROPE_CACHE_FP32``, as on CUDA);
- ``DeepseekScalingRotaryEmbedding.forward_native``: its neox branch broadcasts ``[T, D]`` tables to
  ``[1, T, H, D]``; replaced by the same rotation with per-token tables (the GPT-J branch is SGLang's);
- ``kernels.ops.quantization.hadamard.hadamard_transform`` (CUDA JIT): a Sylvester Hadamard matmul;
- ``Indexer.forward_native`` -> ``Indexer.forward_cuda`` and, after construction,
  ``dsa_indexer._is_cuda = True`` (the indexer's platform dispatch / gate) with the SM-count fields
  its CUDA constructor would read from DeepGEMM (``sm_count = 8``);
- ``dsa_indexer.can_use_dsa_fused_store`` -> False (the CUDA-JIT fused quantise + store; SGLang's
  fallback, ``act_quant`` and the pool's Triton index-K writer, runs instead);
- ``act_quant_triton.act_quant``: a Triton kernel, but Triton's CPU interpreter stores fp32 -> e4m3
  without the mantissa carry (124 becomes 64); the same block quantisation in torch;
- ``Indexer._weights_proj_bf16_in_fp32_out``: ``torch.mm(..., out_dtype=float32)`` is CUDA-only;
  an fp32 matmul;
- ``Indexer._get_topk_ragged``: asserts an indexed CUDA device to size its logits chunks; the same
  unchunked calls (pool read, resolved ``fp8_mqa_logits``, masking, ``topk_transform``);
- ``dsa_backend.seqlens_expand_triton``: the causal key count per query row in torch;
- the indexer's ``torch.compile``'d helpers run eagerly (``torch.compiler.set_stance("force_eager")``).

SGLang's Triton index-K cache writer and reader run in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set by ``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("sglang")

import torch

from nsa_backend.routing import reset_config
from nsa_backend.routing.validate import CHOICE_TO_IMPL
from tests.integrations import sglang_layer_support as sl

PAGE_TABLES = [[5, 2, 7], [3, 6, 1]]  # request r owns these (shuffled) pages
STEPS = [
    sl.Step("prefill", "extend", [0, 0], [60, 20]),
    # request 0 reaches 100 keys (> index_topk = 64: top-k drops keys), request 1 45 (keeps all)
    sl.Step("prefill over a cached prefix", "extend", [60, 20], [40, 25]),
    sl.Step("decode", "decode", [100, 45], [1, 1]),
    sl.Step("MTP target verify", "verify", [101, 46], [sl.DRAFT, sl.DRAFT]),
    sl.Step("MTP draft extend", "draft_extend", [101, 46], [sl.DRAFT, sl.DRAFT]),
]
# Output error allowed, relative to the largest reference output, per cache dtype (e4m3 rows
# quantise the latent per 128 values).
TOLERANCE = {torch.bfloat16: 0.02, torch.float8_e4m3fn: 0.06}


SCALED = ("flashmla_sparse", "flashmla_kv")
# What a launch resolves with no --dsa-*-backend flag: (model, arch, cache dtype) -> (prefill, decode).
# FP8 on sm100 / sm120 (but GLM-5 on sm120): SGLang picks trtllm, the plugin's hook replaces it.
RESOLVED = {
    ("v32", "sm90", "fp8_e4m3"): ("flashmla_kv", "flashmla_kv"),
    ("v32", "sm90", "bfloat16"): ("flashmla_sparse", "fa3"),
    ("v32", "sm100", "fp8_e4m3"): SCALED,
    ("v32", "sm100", "bfloat16"): ("flashmla_sparse", "trtllm"),
    ("v32", "sm120", "fp8_e4m3"): SCALED,
    ("v32", "sm120", "bfloat16"): ("flashmla_sparse", "trtllm"),
    ("glm5", "sm90", "fp8_e4m3"): ("flashmla_kv", "flashmla_kv"),
    ("glm5", "sm90", "bfloat16"): ("flashmla_sparse", "fa3"),
    ("glm5", "sm100", "fp8_e4m3"): SCALED,
    ("glm5", "sm100", "bfloat16"): ("flashmla_sparse", "trtllm"),
    ("glm5", "sm120", "fp8_e4m3"): ("flashinfer_sparse_mla", "flashinfer_sparse_mla"),
    ("glm5", "sm120", "bfloat16"): ("flashmla_sparse", "trtllm"),
}
DEFAULT_KV = {"sm90": "bfloat16", "sm100": "fp8_e4m3", "sm120": "fp8_e4m3"}  # SGLang's "auto" for DSA


@dataclasses.dataclass(frozen=True)
class Case:
    backend: str  # the --attention-backend value
    model: str  # key of sglang_layer_support.MODEL_ARCHS
    arch: str  # simulated GPU, key of sglang_layer_support.SM_CAPABILITY
    kv: str  # --kv-cache-dtype as typed ("auto": SGLang's default for the arch)
    prefill_flag: str | None = None  # --dsa-prefill-backend as typed
    decode_flag: str | None = None  # --dsa-decode-backend as typed
    pd_decode: bool = False  # a PD-disaggregated decode worker (the prefill steps run on a prefill worker)
    expect: tuple[str, str, str] | None = None  # resolved (cache dtype, prefill, decode); None: the defaults

    @property
    def id(self) -> str:
        flags = "".join(
            f"-{phase}_{flag}" for phase, flag in (("prefill", self.prefill_flag), ("decode", self.decode_flag)) if flag
        )
        return f"{self.backend}-{self.model}-{self.arch}-kv_{self.kv}{flags}{'-pd_decode' if self.pd_decode else ''}"

    @property
    def expected(self) -> tuple[str, str, str]:
        if self.expect is not None:
            return self.expect
        kv = DEFAULT_KV[self.arch] if self.kv == "auto" else self.kv
        return (kv, *RESOLVED[(self.model, self.arch, kv)])


CASES = [
    # by name: the model applies RoPE itself whatever SGLang resolved
    Case("nsa_backend", "v32", "sm90", "auto"),
    Case("nsa_backend", "v32", "sm100", "auto"),  # FP8: trtllm replaced by the scaled pair
    Case("nsa_backend", "glm5", "sm120", "auto"),
    # takeover: every (model, arch) SGLang's resolution distinguishes, with its default cache dtype
    # ("auto": bf16 on sm90, FP8 on sm100 / sm120) and the other one
    *[
        Case("dsa", model, arch, kv)
        for model in ("v32", "glm5")
        for arch in ("sm90", "sm100", "sm120")
        for kv in ("auto", "bfloat16" if arch != "sm90" else "fp8_e4m3")
    ],
    # fused RoPE: a PD decode worker with the FlashMLA decode kernel sizes the scaled FP8 pool from its
    # decode choice, while the prefill phase resolves to trtllm, so the model leaves RoPE to the backend
    Case(
        "dsa", "v32", "sm100", "auto", decode_flag="flashmla_kv", pd_decode=True,
        expect=("fp8_e4m3", "trtllm", "flashmla_kv"),
    ),
    Case(
        "dsa", "glm5", "sm100", "auto", decode_flag="flashmla_kv", pd_decode=True,
        expect=("fp8_e4m3", "trtllm", "flashmla_kv"),
    ),
    # the user's TRT-LLM for both phases: SGLang's own attention kernels on their raw rows
    Case(
        "dsa", "v32", "sm100", "auto", prefill_flag="trtllm", decode_flag="trtllm",
        expect=("fp8_e4m3", "trtllm", "trtllm"),
    ),
]
# A typed trtllm for one phase while nsa-backend runs the other, FP8: refused when the server starts.
REFUSED = [
    Case("nsa_backend", "v32", "sm100", "auto", prefill_flag="flashmla_sparse", decode_flag="trtllm"),
    Case("dsa", "glm5", "sm100", "auto", prefill_flag="trtllm"),
]


@dataclasses.dataclass
class Call:
    """What the layer passed to the backend's ``forward_extend`` / ``forward_decode``."""

    topk_indices: torch.Tensor
    method: object
    fused_rope: bool


def spy_backend(backend, calls: list[Call]) -> None:
    """Record each attention call on the instance; the backend's own methods still run."""
    for name in ("forward_extend", "forward_decode"):
        original = getattr(backend, name)

        def forward(q, k, v, layer, forward_batch, *args, original=original, **kwargs):
            calls.append(
                Call(
                    topk_indices=kwargs["topk_indices"].clone(),
                    method=backend.get_topk_transform_method(forward_batch.forward_mode),
                    fused_rope=kwargs.get("cos_sin_cache") is not None,
                )
            )
            return original(q, k, v, layer, forward_batch, *args, **kwargs)

        setattr(backend, name, forward)


def selected_positions(call: Call, step: sl.Step, runner: sl.Runner, backend) -> list[tuple[int, set[int]]]:
    """(request, selected key positions) per query token, from the layer's top-k indices (ragged rows
    of SGLang's per-batch key list or cache slots, as the backend's transform method says)."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    req_to_token = runner.req_to_token_pool.req_to_token
    where = {int(req_to_token[r, p]): (r, p) for r in range(len(PAGE_TABLES)) for p in range(sl.MAX_CTX)}
    ends = [s + n for s, n in zip(step.starts, step.counts)]
    ragged_keys = torch.cat([req_to_token[r, :e] for r, e in enumerate(ends)])
    out = []
    row = 0
    for r, n in enumerate(step.counts):
        for _ in range(n):
            idx = [int(i) for i in call.topk_indices[row] if i >= 0]
            if not backend.use_fused_topk:
                positions = [(r, i) for i in idx]
            elif call.method == TopkTransformMethod.RAGGED:
                positions = [where[int(ragged_keys[i])] for i in idx]
            else:
                positions = [where[i] for i in idx]
            assert all(req == r for req, _ in positions), f"row {row} selected keys of another request"
            assert len(set(positions)) == len(positions), f"row {row} selected a key twice"
            out.append((r, {p for _, p in positions}))
            row += 1
    return out


def check_topk(logits: torch.Tensor, chosen: set[int], visible: int, where: str) -> None:
    """``chosen`` is a top-``index_topk`` set of ``logits`` (ties and fp8 rounding at the boundary
    tolerated)."""
    k = min(sl.TOPK, visible)
    assert len(chosen) == k and max(chosen) < visible, f"{where}: {len(chosen)} keys chosen of {visible}, want {k}"
    kth = torch.topk(logits, k).values[-1]
    slack = 1e-2 * float(logits.abs().max()) + 1e-6
    sel = torch.tensor(sorted(chosen))
    rest = torch.ones(visible, dtype=torch.bool)
    rest[sel] = False
    assert float(logits[sel].min()) >= kth - slack, f"{where}: a chosen key scores below the top-{k} boundary"
    if rest.any():
        assert float(logits[rest].max()) <= kth + slack, f"{where}: a top-{k} key was not chosen"


@pytest.fixture
def sglang_cpu(monkeypatch):
    sl.cpu_replacements(monkeypatch)
    sl.init_process()
    # A typed FlashMLA / FlashInfer choice selects GPU kernels; on CPU tensors the same backend path
    # runs nsa-backend's "auto" route (the reference ops) instead.
    for name, impl in list(CHOICE_TO_IMPL.items()):
        if impl is not None and impl not in ("auto", "reference", "triton"):
            monkeypatch.setitem(CHOICE_TO_IMPL, name, "auto")
    for var in ("NSA_BACKEND_PREFILL", "NSA_BACKEND_DECODE", "NSA_BACKEND_FORCE_ARCH"):
        monkeypatch.delenv(var, raising=False)
    reset_config()
    yield
    reset_config()


def run_steps(ctx: dict, layer, weights, runner, backend, steps: list[sl.Step], fused: bool) -> None:
    """Run ``steps`` through the layer and check each against the reference (``ctx``: the label,
    the per-request token history and the input generator, shared by the workers of a case)."""
    calls: list[Call] = []
    spy_backend(backend, calls)
    label, history, gen = ctx["label"], ctx["history"], ctx["gen"]
    kv_dtype = runner.kv_cache_dtype
    for step in steps:
        fb = sl.forward_batch(step, runner, backend)
        hidden = torch.randn(fb.positions.shape[0], sl.HIDDEN, generator=gen).to(torch.bfloat16)
        calls.clear()
        out = sl.run_layer(layer, backend, fb, hidden).float()
        where = f"{label}, {step.name}"
        assert len(calls) == 1, f"{where}: {len(calls)} attention calls"
        assert calls[0].fused_rope == fused, f"{where}: the model left RoPE to the backend: {calls[0].fused_rope}"
        with torch.no_grad():
            states = sl.token_states(weights, hidden, fb.positions)
            requests = [r for r, n in enumerate(step.counts) for _ in range(n)]
            for state, r, p in zip(states, requests, fb.positions.tolist()):
                history[r][p] = state
            chosen = selected_positions(calls[0], step, runner, backend)
            ref = torch.empty_like(out)
            for t, ((r, keys), p) in enumerate(zip(chosen, fb.positions.tolist())):
                visible = [history[r][j] for j in range(p + 1)]
                check_topk(sl.index_logits(states[t], visible), keys, p + 1, f"{where}, request {r} position {p}")
                ref[t] = sl.attention(weights, states[t], [history[r][j] for j in sorted(keys)])
        err = (out - ref).abs().max().item()
        limit = TOLERANCE[kv_dtype] * ref.abs().max().item()
        assert err <= limit, f"{where}: layer output differs from the reference by {err:.4f} (allowed {limit:.4f})"


def typed_flags(case: Case) -> dict[str, object]:
    """The case's command-line flags that SGLang's resolution reads, besides the attention backend."""
    flags: dict[str, object] = {}
    if case.kv != "auto":
        flags["kv_cache_dtype"] = case.kv
    if case.prefill_flag:
        flags["dsa_prefill_backend"] = case.prefill_flag
    if case.decode_flag:
        flags["dsa_decode_backend"] = case.decode_flag
    if case.pd_decode:
        flags["disaggregation_mode"] = "decode"
    return flags


def launch(monkeypatch, tmp_path, case: Case, backend: str, flags: dict[str, object]) -> dict[str, object]:
    """SGLang's resolved ``kv_cache_dtype`` / ``dsa_*_backend`` of a launch of ``case``'s model on its GPU."""
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in flags.items()]
    config_dir = sl.model_config_dir(case.model, str(tmp_path))
    args = sl.launch_server(monkeypatch, config_dir, sl.SM_CAPABILITY[case.arch][0], *argv, backend=backend)
    return sl.resolved_dsa_args(args)


def make_backend(name: str, runner: sl.Runner):
    """The backend SGLang's registry builds for ``name``."""
    from sglang.srt.layers.attention import attention_registry

    backend = attention_registry.ATTENTION_BACKENDS[name](runner)
    assert type(backend).__module__ == "nsa_backend_integrations.sglang.backend", type(backend)
    return backend


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_sglang_layer_matches_reference(case: Case, sglang_cpu, monkeypatch, tmp_path):
    takeover = case.backend != "nsa_backend"
    ctx = {"history": [{} for _ in PAGE_TABLES], "gen": torch.Generator().manual_seed(7)}
    steps = STEPS
    with sl.plugin_registered(monkeypatch, takeover):
        resolved = launch(monkeypatch, tmp_path, case, case.backend, typed_flags(case))
        got = (resolved["kv_cache_dtype"], resolved["dsa_prefill_backend"], resolved["dsa_decode_backend"])
        assert got == case.expected, f"{case.id}: SGLang resolved {got}, expected {case.expected}"
        kv_dtype = torch.float8_e4m3fn if resolved["kv_cache_dtype"] == "fp8_e4m3" else torch.bfloat16
        # What forward_mla.py's _fuse_rope_for_trtllm_mla decides: skip RoPE in the model and pass
        # cos_sin_cache / is_neox to a backend named dsa / nsa when a phase resolved to trtllm with FP8.
        fused = takeover and kv_dtype == torch.float8_e4m3fn
        fused = fused and "trtllm" in (resolved["dsa_prefill_backend"], resolved["dsa_decode_backend"])
        ctx["label"] = f"{case.id} (SGLang resolved {resolved}; fused RoPE: {fused})"
        if case.pd_decode:
            # The prefill worker (by name, FlashMLA kernels typed) writes the prompts' KV cache.
            flags = {**typed_flags(case), "dsa_prefill_backend": "flashmla_sparse"}
            flags.pop("disaggregation_mode")
            prefill = launch(monkeypatch, tmp_path, case, "nsa_backend", flags)
            assert (prefill["dsa_prefill_backend"], prefill["dsa_decode_backend"]) == SCALED
            typed = {"attention_backend": "nsa_backend", "speculative_num_draft_tokens": sl.DRAFT, **flags}
            with sl.published(typed, prefill) as args:
                layer, weights = sl.build_layer(case.model)
                runner = sl.Runner(case.model, kv_dtype, args, PAGE_TABLES)
                with monkeypatch.context() as gate:
                    sl.open_indexer_gate(gate, layer)
                    run_steps(ctx, layer, weights, runner, make_backend("nsa_backend", runner), STEPS[:2], False)
            steps = STEPS[2:]
        typed = {"attention_backend": case.backend, "speculative_num_draft_tokens": sl.DRAFT, **typed_flags(case)}
        with sl.published(typed, resolved) as args:
            if case.pd_decode:
                runner = runner.worker(args)
            else:
                layer, weights = sl.build_layer(case.model)
                runner = sl.Runner(case.model, kv_dtype, args, PAGE_TABLES)
            pool = runner.token_to_kv_pool
            if kv_dtype == torch.float8_e4m3fn and "trtllm" not in got[1:]:
                # the scaled fp8_ds_mla rows nsa-backend's ops read
                assert pool.dsa_kv_cache_store_fp8 and runner.kv_cache_dim == 656, runner.kv_cache_dim
            if case.prefill_flag == "trtllm" and case.decode_flag == "trtllm":
                # SGLang's TRT-LLM attention for both phases reads its raw rows itself (no CPU path to run
                # it here): the backend builds on that pool, with no phase on nsa-backend's ops.
                assert not pool.dsa_kv_cache_store_fp8 and runner.kv_cache_dim == 576, runner.kv_cache_dim
                backend = make_backend(case.backend, runner)
                assert (backend.nsa_prefill_impl, backend.nsa_decode_impl) == (None, None)
                return
            sl.open_indexer_gate(monkeypatch, layer)
            run_steps(ctx, layer, weights, runner, make_backend(case.backend, runner), steps, fused)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_mixed_trtllm_choice_refused_at_startup(case: Case, sglang_cpu, monkeypatch, tmp_path):
    """``trtllm`` typed for one phase with an FP8 cache while nsa-backend's ops run the other: SGLang's
    pool would be TRT-LLM's raw rows, so the launch stops with the flags to change."""
    with sl.plugin_registered(monkeypatch, case.backend != "nsa_backend"):
        with pytest.raises(ValueError) as err:
            launch(monkeypatch, tmp_path, case, case.backend, typed_flags(case))
    msg = str(err.value)
    assert "raw FP8 KV-cache layout" in msg and "cannot read" in msg
    assert "Leave both --dsa-prefill-backend and --dsa-decode-backend unset" in msg
    assert "--kv-cache-dtype bfloat16" in msg
