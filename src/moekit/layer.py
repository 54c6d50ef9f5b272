"""`FusedMoE`: an `nn.Module` that owns one MoE layer (router + experts) and the plans that run it.

Data flow:
  construction: (spec, ExpertWeights, router weight/bias, `PlanOptions`) -> every tensor checked against the
    spec (`moekit.checks`, once: the weights, router tensors, correction bias and expert map are this
    layer's from then on) and moved once to the target device -> tuned tables read once -> plan for
    token bucket 1, so an unsupported spec raises the planner's `UnsupportedSpecError` when the model
    loads -> the weights prepared (`Kernel.prepare_weights`) for that plan's kernel -> a handle in the
    custom-op registry.
  forward(hidden_states [..., H], router_logits=None): host-side checks of shape, dtype and device (no
    sync) -> flatten to x [T, H] -> router logits x @ W^T + b in fp32 unless given ->
    `torch.ops.moekit.fused_moe_layer(x, logits, handle)` -> reshape to [..., H].
  inside the op (eager, compiled, or while a CUDA graph is captured): bucket = token_bucket(T) from the
    host-side shape -> that bucket's plan (planned and its kernel's weights prepared on first use) ->
    `moekit.ops.route_checked` (spec.routing, correction bias) -> `moekit.ops.run_checked` (one typed
    `Launch` -> `kernel.run`); no input is checked a second time.
  parallel (`moekit.Parallel`): the layer is built from the global spec and weights and holds this rank's
    share (`moekit.parallel.shard_for`; `spec` is then the local spec). Tensor: I/N, the op's output
    summed over the group by one all-reduce (every rank passes the same tokens). Expert: E_r experts and
    the expert map; each rank routes its own tokens and `moekit.parallel.expert` moves them to their
    experts' ranks and back, the experts run by this layer's plan for the received row count. Eager
    forwards agree first (`moekit.parallel.agreement`), so a rank's refused input raises on every rank.
  warmup(max_tokens): plans every bucket up to max_tokens, prepares weights, and runs each bucket at the
    token counts that reach every compiled variant of its kernel (`Kernel.warmup_token_counts`), so no
    planning, repacking or compilation is left for a forward that is being captured or served.

Device and dtype: build a FusedMoE on its target device (`device=`, default the weights' device): that
avoids a second copy and a second round of planning. `.to(device)` / `.cuda()` (also through a parent
module) still work: they move the source weights and router tensors, drop every plan and prepared copy
and plan bucket 1 again for the new device, all or nothing (a refused device leaves the layer as it was).
Casts are refused (`.half()`, `.to(dtype)` raise DTypeError when they would change the act dtype, and
never touch the tensors otherwise): the dtypes belong to the spec, as a loaded model's dtype does in vLLM
or SGLang. Through a parent module the refusal comes when `nn.Module._apply` reaches this layer, after
the parent's earlier children were cast; `check_conversion` asks without changing anything, so a parent
can refuse first (the Hugging Face patch does, for the whole model). Expert weights are plain attributes
and the router tensors non-persistent buffers, so `state_dict()` is empty: rebuild the layer from its
checkpoint rather than loading a state dict into it (a patched HF block saves and loads its own).

Inference only: a backward through the custom op raises `ArgumentError` (`moekit.custom_op`). Value
checks that would sync (expert-id ranges) are unnecessary here: `route` only produces ids in [0, E). One
value check stays: router logits must be finite (the contract in `moekit.routing`). It runs inside the op,
in eager and compiled forwards, and reads one bool from the device (a sync); it is skipped while a CUDA
graph is being captured, and when `layer.check_values = False` (a server that wants no sync in eager
forwards either), where a token with a NaN or +-inf logit gets a NaN output row instead of an error.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from moekit.checks import (
    capturing,
    check_expert_map,
    check_expert_map_given,
    check_finite_logits,
    check_hidden_states,
    check_layer_tensors,
    check_router_logits,
)
from moekit.custom_op import register_layer  # importing it registers torch.ops.moekit.fused_moe_layer
from moekit.errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    LayoutMismatchError,
    ShapeError,
    SpecError,
    UnsupportedSpecError,
    check_type,
)
from moekit.kernels.base import DeviceInfo, Kernel
from moekit.kernels.registry import default_registry
from moekit.layer_support import WarmupReport, bool_setting, indexed_device
from moekit.ops import route_checked, run_checked
from moekit.parallel import Parallel, ParallelMode
from moekit.parallel.agreement import agree, refused_in_forward
from moekit.parallel.build import agree_warmup, layer_share, refused_in_construction
from moekit.parallel.expert import EpChoice, ExpertParallel
from moekit.planning.options import PlanOptions
from moekit.planning.plan import Plan, plan_batch_invariant, resolve_tables
from moekit.planning.plan import plan as make_plan
from moekit.planning.tuned import token_bucket
from moekit.router import batch_invariant_routing_reason, compute_router_logits
from moekit.routing import RoutingResult, count_per_expert
from moekit.spec import MoESpec
from moekit.weights import ExpertWeights


class FusedMoE(torch.nn.Module):
    """One MoE layer: router + experts of `spec`, planned at construction. See the module docstring."""

    # Refuse non-finite router logits with NonFiniteError (a sync per forward, none while capturing).
    # Parallel: the same on every rank; tensor parallel refuses a rank's bad inputs on every rank only with
    # it on (expert parallel always does): `moekit.parallel.agreement`.
    check_values = bool_setting("check_values", True)
    # Count each forward's (token, k) pairs per global expert into `tokens_per_expert` (two small kernels,
    # no sync: graphs captured with it on keep counting); off by default.
    count_tokens_per_expert = bool_setting("count_tokens_per_expert", False)

    def __init__(
        self,
        *,
        spec: MoESpec,
        weights: ExpertWeights,
        router_weight: torch.Tensor | None,
        router_bias: torch.Tensor | None = None,
        correction_bias: torch.Tensor | None = None,
        expert_map: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        options: PlanOptions | None = None,
        parallel: Parallel | None = None,
        presharded: bool = False,  # weights are `parallel`'s share already (a checkpoint read it): no cut
    ) -> None:
        super().__init__()
        check_type("parallel", parallel, Parallel, optional=True, fix="pass moekit.Parallel.tensor(group)")
        with refused_in_construction(parallel):  # one rank refusing its arguments: every rank raises
            if not isinstance(spec, MoESpec):
                raise SpecError(f"spec must be a MoESpec, got {type(spec).__name__}")
            if not isinstance(weights, ExpertWeights):
                raise SpecError(f"weights must be ExpertWeights, got {type(weights).__name__}")
            options = PlanOptions() if options is None else options
            if not isinstance(options, PlanOptions):
                raise SpecError(f"options must be PlanOptions, got {type(options).__name__}")
            dev = indexed_device(weights.device if device is None else device)
        if presharded and parallel is None:
            raise ArgumentError("presharded=True: the weights are a share of which group? pass parallel= too")
        self._ep: ExpertParallel | None = None
        if parallel is not None:  # this rank's share, cut before the move so only the share is copied
            router = (router_weight, router_bias, correction_bias)  # a collective: all raise, or none
            share = spec, weights, expert_map
            spec, weights, expert_map = layer_share(parallel, *share, presharded, router, dev)
            if parallel.mode is ParallelMode.EXPERT:
                self._ep = ExpertParallel(parallel, spec)
        self.parallel = parallel
        self._device_info = DeviceInfo.of(dev)  # plan's DeviceError, before any tensor moves or is read
        # One-time load step: move, and make every tensor contiguous (the fused kernels read rows).
        weights = weights.to(dev) if weights.device != dev else weights
        weights = replace(weights, **{n: t.contiguous() for n, t in weights.tensors().items()})
        if parallel is None:  # a parallel rank checked its share before the group agreed (`layer_share`)
            check_layer_tensors(spec, weights, router_weight, router_bias, correction_bias)
        self.spec = spec
        self.options = options
        self.weights = weights  # source weights; kernels read `_prepared[kernel]`
        self._device = dev
        # Checked above (`check_layer_tensors`): this layer's from now on, its values read once, there.
        for name, t in (("router_weight", router_weight), ("router_bias", router_bias)):
            self.register_buffer(name, None if t is None else t.detach().to(dev), persistent=False)
        bias = None if correction_bias is None else correction_bias.detach().to(dev)
        self.register_buffer("correction_bias", bias, persistent=False)
        check_expert_map_given(spec, expert_map)
        if expert_map is not None:
            expert_map = expert_map.to(dev)
            check_expert_map(expert_map, num_experts=spec.E, num_local_experts=spec.E_local)
        self.register_buffer("expert_map", expert_map, persistent=False)
        zeros = torch.zeros(spec.E, dtype=torch.int32, device=dev)
        self.register_buffer("tokens_per_expert", zeros, persistent=False)  # this rank's tokens, last forward

        self._registry = options.registry or default_registry()
        self._tables = resolve_tables(options.tuned, self._registry)  # read once, not per bucket
        self._plans: dict[int, Plan] = {}
        self._prepared: dict[str, ExpertWeights] = {}
        self._kernels: dict[str, Kernel] = {}
        if options.batch_invariant and (why := batch_invariant_routing_reason(spec, dev)) is not None:
            raise UnsupportedSpecError(f"PlanOptions(batch_invariant=True) cannot hold here: {why}")
        self.plan_for(1)  # refuse early: the planner's UnsupportedSpecError surfaces at load time
        self._handle = register_layer(self)

    # ----- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_gpt_oss_checkpoint(
        cls,
        path: str | Path,
        layer: int,
        *,
        device: torch.device | str = "cpu",
        act_dtype: torch.dtype = torch.bfloat16,
        top_k: int = 4,
        naming=None,  # moekit.checkpoint.CheckpointNaming | None: detected when None
        options: PlanOptions | None = None,
        parallel: Parallel | None = None,
    ) -> FusedMoE:
        """Layer `layer` of a GPT-OSS MXFP4 checkpoint (OpenAI or Hugging Face naming), read onto `device`
        (with `parallel`: only this rank's share of the experts is read, `moekit.parallel.RankShare`)."""
        from moekit.checkpoint.fused import gpt_oss_checkpoint_layer

        return gpt_oss_checkpoint_layer(
            cls, path, layer, device=device, act_dtype=act_dtype, top_k=top_k, naming=naming,
            options=options, parallel=parallel,
        )  # fmt: skip

    @classmethod
    def from_hf_checkpoint(
        cls,
        path: str | Path,
        layer: int,
        *,
        config=None,  # config.json as a path or a dict; None: the folder's
        device: torch.device | str = "cpu",
        act_dtype: torch.dtype = torch.bfloat16,
        options: PlanOptions | None = None,
        parallel: Parallel | None = None,
    ) -> FusedMoE:
        """Layer `layer` of a per-expert Hugging Face checkpoint (`moekit.checkpoint.load_hf_moe_layer`:
        Mixtral, Qwen, OLMoE, DeepSeek-V2/V3, GLM-4.5/4.7-Flash, dots1, MiniMax-M2; float, FP8 block-128, or
        compressed-tensors FP8), the routed experts only; with `parallel`, only this rank's share is read."""
        from moekit.checkpoint.fused import hf_checkpoint_layer

        return hf_checkpoint_layer(
            cls, path, layer, config=config, device=device, act_dtype=act_dtype, options=options,
            parallel=parallel,
        )  # fmt: skip

    # ----- planning ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def handle(self) -> int:
        """This layer's id in the custom op's registry."""
        return self._handle

    @property
    def plans(self) -> dict[int, Plan]:
        """Bucket -> plan, for the buckets planned so far."""
        return dict(self._plans)

    def plan_for(self, num_tokens: int) -> Plan:
        """The plan of `num_tokens`'s bucket (planned, and its kernel's weights prepared, on first use)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ShapeError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        bucket = token_bucket(num_tokens)
        found = self._plans.get(bucket)
        if found is not None:
            return found
        opts = self.options
        new = (plan_batch_invariant if opts.batch_invariant else make_plan)(
            self.spec,
            num_tokens=bucket,
            device=self._device_info,
            tuned=self._tables,
            strict=opts.strict,
            registry=self._registry,
            allow_reference=opts.allow_reference,
        )
        self._prepare(new)
        self._plans[bucket] = new
        return new

    def _prepare(self, plan: Plan) -> None:
        if plan.kernel in self._prepared:
            return
        kernel = self._registry.get(plan.kernel)
        if kernel is None:
            raise LayoutMismatchError(f"plan names kernel {plan.kernel!r}, which is not in the registry")
        prepared = kernel.prepare_weights(self.weights, plan.spec)  # validated when the layer was built
        if (reason := kernel.weights_reason(prepared)) is not None:
            raise LayoutMismatchError(f"kernel {kernel.name} cannot read its own prepared weights: {reason}")
        self._kernels[plan.kernel] = kernel
        self._prepared[plan.kernel] = prepared

    def explain(self) -> str:
        """The parallel mode (and expert-parallel engine), then every plan made so far, bucket by bucket."""
        head = [] if self.parallel is None else [f"[parallel] {self.parallel.describe()}"]
        if self._ep is not None:
            head = [self._ep.explain()]
        return "\n\n".join(head + [f"[bucket {b}]\n{p.explain()}" for b, p in sorted(self._plans.items())])

    def warmup(self, max_tokens: int, *, execute: bool = True) -> WarmupReport:
        """Plan every bucket up to `max_tokens`, prepare weights, and (if `execute`) run each bucket at
        the token counts of its kernel's `warmup_token_counts`, so kernels compile now rather than while
        serving. Parallel: every rank of the group calls it; all warm up to the group's largest
        `max_tokens`, running forwards if any rank executes (the same collectives on every rank)."""
        refused = None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            refused = ShapeError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if self.parallel is not None:
            max_tokens, execute = agree_warmup(self.parallel, max_tokens, execute, refused, self._device)
        elif refused is not None:
            raise refused
        plans: list[Plan] = []
        counts: list[int] = []
        bucket = 1
        # Expert parallel: the experts see up to N x max_tokens rows, and every rank must run the same
        # sequence of collectives, so each bucket gets one forward through the group (the same on every
        # rank) and the kernels' variants are compiled by local expert runs (`_warmup_local_experts`).
        last = token_bucket(max_tokens * (1 if self._ep is None else self._ep.parallel.world_size))
        with torch.no_grad():
            while True:
                p = self.plan_for(bucket)
                plans.append(p)
                if execute and self._ep is not None:
                    self._warmup_local_experts(p)
                    if bucket <= max_tokens:
                        counts.append(bucket)
                        self.forward(self._zeros(bucket, self.spec.H, self.spec.act_dtype))
                elif execute:
                    kernel = self._kernels[p.kernel]
                    for t in kernel.warmup_token_counts(bucket, self.spec, p.config):
                        logits = self._zeros(t, self.spec.E, torch.float32)
                        self.forward(self._zeros(t, self.spec.H, self.spec.act_dtype), router_logits=logits)
                        counts.append(t)
                if bucket >= last:
                    break
                bucket *= 2
        if execute and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # warmup is off the hot path: surface launch errors here
        return WarmupReport(plans=tuple(plans), token_counts=tuple(counts))

    def _zeros(self, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(rows, columns, dtype=dtype, device=self._device)

    def _warmup_local_experts(self, plan: Plan) -> None:
        """Run this rank's experts alone (no collective) at every warmup count of `plan`'s bucket, each
        token routed to this rank's own experts so the kernels really run."""
        kernel = self._kernels[plan.kernel]
        for t in kernel.warmup_token_counts(plan.bucket, self.spec, plan.config):
            routing = self._ep.routing_to_own_experts(t, self.expert_map)
            self.run_local_experts(self._zeros(t, self.spec.H, self.spec.act_dtype), routing)

    def workspace_bytes(self, num_tokens: int) -> int:
        """Device memory one forward of `num_tokens` allocates beyond the weights (output included).

        The kernel reports its own workspace (`Kernel.workspace_bytes`); the layer adds router logits,
        routing results and the output.
        """
        plan = self.plan_for(num_tokens)
        spec, pairs = self.spec, num_tokens * self.spec.K
        act = torch.empty((), dtype=spec.act_dtype).element_size()
        kernel_bytes = self._kernels[plan.kernel].workspace_bytes(spec, num_tokens, plan.config)
        layer_bytes = num_tokens * spec.E * 4 + pairs * 8 + num_tokens * spec.H * act  # logits, routing, out
        return kernel_bytes + layer_bytes

    # ----- forward -----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states `[..., H]` (act dtype, this layer's device) -> the MoE output, same shape and dtype.

        `router_logits` `[..., E]` (or flat `[T, E]`; float32, bfloat16, float16 or float64) replaces this
        layer's router. Router logits (given or computed) with a NaN or +-inf in float32 raise
        `NonFiniteError` (module docstring)."""
        spec = self.spec
        x = hidden_states
        agrees = self.parallel is not None and (self._ep is not None or self.check_values)
        # a rank whose inputs are refused joins the agreement its peers wait in, so that they raise too
        with refused_in_forward(self.parallel.group if agrees and not capturing(x) else None, self._device):
            check_hidden_states(x, spec=spec, device=self._device)
            check_router_logits(
                router_logits,
                hidden_states=x,
                spec=spec,
                device=self._device,
                has_router=self.router_weight is not None,
            )
        flat = x.reshape(-1, spec.H)
        if router_logits is None:
            logits = compute_router_logits(
                flat, self.router_weight, self.router_bias, batch_invariant=self.options.batch_invariant
            )
        else:
            logits = router_logits.reshape(-1, spec.E)
        out = torch.ops.moekit.fused_moe_layer(flat, logits, self._handle)
        return out.reshape(x.shape)

    def run_flat(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The op's body: x `[T, H]` and logits `[T, E]` (already checked) -> `[T, H]`. Host work only,
        but for the finite-logits check (one sync; skipped while capturing or with `check_values` off)."""
        spec = self.spec
        checked = self.check_values and not capturing(router_logits)
        if checked and self.parallel is None:
            check_finite_logits(router_logits)
        elif checked and self._ep is None:  # tensor parallel: the group refuses bad logits or T together
            agreement = agree(x.shape[0], router_logits, group=self.parallel.group, device=x.device)
            agreement.raise_for_group(router_logits, where="tensor parallel", same_tokens=True)
        routing = route_checked(
            router_logits, top_k=spec.K, spec=spec.routing, correction_bias=self.correction_bias
        )
        if self.count_tokens_per_expert:
            count_per_expert(routing.ids, out=self.tokens_per_expert)
        if self._ep is not None:
            # The group refuses non-finite logits together (`ExpertParallel.forward`).
            return self._ep.forward(
                x, routing, self.run_local_experts, logits=router_logits if checked else None
            )
        out = self.run_local_experts(x, routing)
        if self.parallel is not None:  # tensor parallel: each rank holds a partial sum over its I/N
            torch.distributed.all_reduce(out, group=self.parallel.group)
        return out

    def ep_choice(self, max_tokens: int) -> EpChoice:
        """Expert parallel: the engine a forward uses when the group's largest per-rank T is `max_tokens`."""
        if self._ep is None:
            raise ArgumentError("ep_choice: this layer is not expert parallel (no Parallel.expert)")
        return self._ep.choice_for(max_tokens)

    def run_local_experts(self, x: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """This layer's experts on x `[T, H]` routed to global ids, by the plan of T's bucket."""
        plan = self.plan_for(x.shape[0])
        # Every input was checked once, before this point: x and the logits by `forward`, the weights,
        # their packing, the correction bias and the expert map when the layer built and prepared them;
        # ids from `route` are in range by construction. Nothing below reads device memory.
        return run_checked(
            self._kernels[plan.kernel],
            plan,
            x,
            self._prepared[plan.kernel],
            routing,
            expert_map=self.expert_map,
        )

    # ----- module plumbing ---------------------------------------------------------------------------
    def check_conversion(self, fn) -> torch.device:  # noqa: ANN001 - an nn.Module._apply function
        """The device `fn` (what `.to()`, `.half()`, `.cuda()` apply to each tensor) would move this layer
        to; `DTypeError` if it would change the act dtype, `DeviceError` for a device moekit does not run
        on. Changes nothing, so a parent can ask every moekit layer first and refuse a cast before any of
        its own tensors changes."""
        try:
            probe = fn(torch.empty(0, dtype=self.spec.act_dtype, device=self._device))
        except (AssertionError, RuntimeError) as err:  # not even an empty tensor: no such device here
            raise DeviceError(
                f"FusedMoE cannot move there: torch refused the device ({err}); moekit runs on the CPU and "
                f"on the CUDA devices this machine has ({torch.cuda.device_count()})"
            ) from err
        if probe.dtype != self.spec.act_dtype:
            raise DTypeError(
                f"FusedMoE runs in act_dtype {self.spec.act_dtype} and cannot be cast to "
                f"{probe.dtype}: build it with a spec of that act_dtype (for a patched Hugging Face "
                "model: unpatch, cast, patch again)"
            )
        device = indexed_device(probe.device)
        DeviceInfo.of(device)  # refuses a device type moekit does not run on
        return device

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        # `fn` is never applied to this layer's tensors (a model-wide `.to(dtype)` would cast fp32 biases
        # or FP32-format weights behind the spec's back): a device change moves the layer and plans again
        # for the new device; an act-dtype change is refused.
        device = self.check_conversion(fn)
        if device != self._device:
            self._move(device)
        return self

    def _move(self, device: torch.device) -> None:
        """Move weights and router tensors to `device`, drop every plan and prepared copy, plan bucket 1.

        All or nothing: if the new device is refused (no moekit device, no capable kernel there), the
        layer keeps its tensors, device and plans exactly as they were."""
        saved = (self.weights, dict(self._buffers), self._device, self._device_info)
        caches = (dict(self._plans), dict(self._prepared), dict(self._kernels))
        try:
            self._device_info = DeviceInfo.of(device)  # an unknown device type is refused before any copy
            self.weights = self.weights.to(device)
            for name in (
                "router_weight",
                "router_bias",
                "correction_bias",
                "expert_map",
                "tokens_per_expert",
            ):
                if self._buffers.get(name) is not None:
                    self._buffers[name] = self._buffers[name].to(device)
            self._device = device
            for cache in (self._plans, self._prepared, self._kernels):
                cache.clear()
            self.plan_for(1)  # the new device may refuse the spec: say so now, not at the next forward
        except BaseException:
            self.weights, buffers, self._device, self._device_info = saved
            self._buffers.update(buffers)
            for cache, old in zip((self._plans, self._prepared, self._kernels), caches, strict=True):
                cache.clear()
                cache.update(old)
            raise

    def __setstate__(self, state: dict) -> None:  # unpickling: a new process, a new handle
        super().__setstate__(state)
        self._handle = register_layer(self)

    def extra_repr(self) -> str:
        kernels = ", ".join(f"{b}:{p.kernel}" for b, p in sorted(self._plans.items()))
        return f"{self.spec.describe()}, device={self._device}, plans={{{kernels}}}"
