"""`MoekitMoEBlock`: the moekit layer that takes a Hugging Face MoE block's place, saved and cast like it.

Data flow:
  forward(hidden [B, S, H]): HF router (so transformers' router-logit recording still sees it) -> its
    logits -> `FusedMoE(x, router_logits=...)` (routed experts; DeepSeek-V3's correction bias is the
    layer's copy of the router's buffer) -> plus the block's shared experts, run by the original HF
    modules (kept in this block's module tree, so they are saved, loaded, moved and cast with it), added
    after the layer's output is complete (after a tensor-parallel all-reduce: once, not once per rank)
    -> the HF block's return signature (`(hidden, router_scores)` or `hidden`).
  release: the original experts' parameters are emptied (`param.data` -> 0 elements) once a bit-exact
    inverse conversion (`convert.hf_expert_tensors`) has been checked, so a patched model holds its
    experts once; `restore_original` rebuilds them into the same Parameter objects (same shape, stride,
    dtype, values).
  state_dict: the block's entries are the original block's, in its order and under its names: the router's
    own tensors, and the experts' tensors rebuilt from moekit's weights (a copy only where the HF layout
    differs from moekit's, as GPT-OSS's transposed one does) -> `save_pretrained` of a patched model
    writes the checkpoint the unpatched model writes.
  load_state_dict: the experts' entries are copied into the original experts' parameters (as the
    unpatched block would load them), converted again and a new `FusedMoE` built from them and from the
    router's correction bias in the state dict, if it holds one (planned, checked: a non-finite bias is
    refused); only then does it replace the old one, so a refused load leaves the block as it was. The
    router and shared experts load as HF modules (MiniMax-M2's block-held correction bias as this
    block's buffer). A correction bias changed in place on the router module after patching is not seen
    by moekit's copy: load it through `load_state_dict`, or patch again.
  casts: a module above patched blocks (the model, its decoder, its layer list) gets a `_CastGuard`: before
    `.half()` / `.to(dtype)` / `.to(device)` changes any tensor, every moekit layer under it is asked
    (`FusedMoE.check_conversion`) and moved; a refused cast (an act-dtype change, a device moekit cannot
    run on) raises before anything changed, so the model stays exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.integrations.transformers.convert import correction_bias_of, from_hf_experts, hf_expert_tensors
from moekit.integrations.transformers.families import Family
from moekit.layer import FusedMoE
from moekit.spec import MoESpec


@dataclass(frozen=True)
class _ReleasedParam:
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _as_released(t: torch.Tensor, rp: _ReleasedParam) -> torch.Tensor:
    """`t` with the released parameter's shape and strides (itself if it has them already)."""
    if tuple(t.shape) == rp.shape and tuple(t.stride()) == rp.stride and t.dtype == rp.dtype:
        return t
    return torch.empty_strided(rp.shape, rp.stride, dtype=rp.dtype, device=t.device).copy_(t)


def convert_moekit_layers_first(module: torch.nn.Module, fn) -> None:  # noqa: ANN001 - an _apply function
    """Ask every `FusedMoE` under `module` whether `fn` may be applied, then move them, all or none.

    Runs before `nn.Module._apply` touches any tensor: a refusal (`DTypeError` for an act-dtype change,
    `DeviceError` for a device moekit does not run on) leaves every tensor as it was."""
    layers = [m for m in module.modules() if isinstance(m, FusedMoE)]
    targets = [layer.check_conversion(fn) for layer in layers]
    moved: list[tuple[FusedMoE, torch.device]] = []
    try:
        for layer, target in zip(layers, targets, strict=True):
            if target != layer.device:
                source = layer.device
                layer.to(target)  # all or nothing per layer (`FusedMoE._move`)
                moved.append((layer, source))
    except BaseException:
        for layer, source in reversed(moved):
            layer.to(source)
        raise


class _CastGuard:
    """A module's `_apply` while it holds patched blocks: moekit layers first, then the usual recursion."""

    def __init__(self, module: torch.nn.Module, inner: object | None) -> None:
        self.module = module
        self.inner = inner  # an `_apply` someone else set on the instance, kept and called

    def __call__(self, fn, recurse: bool = True):  # noqa: ANN001, ANN204 - nn.Module._apply's signature
        if recurse:
            convert_moekit_layers_first(self.module, fn)
        if self.inner is not None:
            return self.inner(fn, recurse)
        return type(self.module)._apply(self.module, fn, recurse)


def guard_casts(model: torch.nn.Module, block_names: list[str]) -> None:
    """Install a `_CastGuard` on `model` and every module between it and each named patched block."""
    for name in block_names:
        parts = name.split(".")
        for depth in range(len(parts)):
            module = model.get_submodule(".".join(parts[:depth]))
            if not isinstance(module.__dict__.get("_apply"), _CastGuard):
                module.__dict__["_apply"] = _CastGuard(module, module.__dict__.get("_apply"))


def unguard_casts(model: torch.nn.Module) -> None:
    """Remove every `_CastGuard` under `model` (restoring an `_apply` it wrapped)."""
    for module in model.modules():
        guard = module.__dict__.get("_apply")
        if isinstance(guard, _CastGuard):
            if guard.inner is None:
                del module.__dict__["_apply"]
            else:
                module.__dict__["_apply"] = guard.inner


class MoekitMoEBlock(torch.nn.Module):
    """Takes an HF MoE block's place: its router module (same attribute name) plus a `FusedMoE`.

    Saved, loaded and cast as the original block would be: `state_dict()` holds the original block's
    entries (experts rebuilt from moekit's weights), `load_state_dict` loads them into moekit's weights,
    and a cast that would change the act dtype is refused before any tensor changes (the dtypes belong
    to the spec: unpatch, cast, and patch again)."""

    def __init__(
        self, *, original: torch.nn.Module, family: Family, moe: FusedMoE, spec: MoESpec | None = None
    ) -> None:
        super().__init__()
        self.family = family
        self.moe = moe
        self.spec = moe.spec if spec is None else spec  # the whole layer's (a parallel `moe` holds a share)
        self.add_module(family.router_name, getattr(original, family.router_name))
        if family.hf.bias_on_block:  # MiniMax-M2's buffer, under its name: saved and loaded as the block's
            self.register_buffer(family.hf.correction_bias, getattr(original, family.hf.correction_bias))
        shared = family.hf.shared
        for name in () if shared is None else (shared.mlp, shared.gate):
            if name is not None:  # the original's own modules, under its names: one set of tensors
                self.add_module(name, getattr(original, name))
        self.__dict__["_original"] = original  # kept out of the module tree: no double state_dict entries
        self._released: tuple[_ReleasedParam, ...] = ()
        self.register_state_dict_post_hook(_state_dict_as_original)

    @property
    def original(self) -> torch.nn.Module:
        return self.__dict__["_original"]

    @property
    def released_original(self) -> bool:
        return bool(self._released)

    def forward(self, hidden_states: torch.Tensor):  # noqa: ANN201 - the HF block's return type
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router = getattr(self, self.family.router_name)
        if self.family.hf.bias_on_block:  # MiniMax-M2's router takes the block's correction bias
            router_logits, router_scores, _ = router(flat, getattr(self, self.family.hf.correction_bias))
        else:
            router_logits, router_scores, _ = router(flat)
        # The layer's output is whole here (a tensor-parallel layer all-reduced it inside), so the shared
        # experts, which every rank runs whole on its own tokens, are added once. Shapes and order of the
        # additions are the HF blocks' own.
        routed = self.moe(flat, router_logits=router_logits)
        shared = self.family.hf.shared
        if shared is None:
            out = routed.reshape(shape)
        elif shared.gate is None:  # DeepSeek-V2/V3, GLM-4.5/4.7-Flash, dots1: routed + shared_experts(x)
            out = routed.reshape(shape) + getattr(self, shared.mlp)(hidden_states)
        else:  # Qwen2-MoE, Qwen3-Next: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            mlp, gate = getattr(self, shared.mlp)(flat), getattr(self, shared.gate)(flat)
            out = (routed + torch.sigmoid(gate) * mlp).reshape(shape)
        return (out, router_scores) if self.family.hf.returns_router_scores else out

    def correction_bias_key(self, prefix: str = "") -> str | None:
        """The state_dict key of the correction bias (None for a family without one)."""
        name = self.family.hf.correction_bias
        return None if name is None else f"{prefix}{name}"

    def release_original(self) -> bool:
        """Empty the original experts' parameters if moekit's weights rebuild them bit-exactly."""
        if self.moe.parallel is not None:
            return False  # one rank's share cannot rebuild the whole experts
        params = dict(self.original.experts.named_parameters())
        rebuilt = hf_expert_tensors(self.family, self.moe.weights)
        if set(params) != set(rebuilt) or list(self.original.experts.buffers()):
            return False
        for name, p in params.items():
            r = rebuilt[name]
            if r.dtype != p.dtype or r.shape != p.shape or r.device != p.device or not torch.equal(r, p):
                return False
        released = []
        for name, p in params.items():
            released.append(_ReleasedParam(name, tuple(p.shape), tuple(p.stride()), p.dtype))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._released = tuple(released)
        return True

    def experts_state(self) -> dict[str, torch.Tensor]:
        """The original experts' state_dict entries (names relative to `experts.`), as the unpatched
        block holds them: rebuilt from moekit's weights where released, the originals' otherwise."""
        if not self._released:
            return {n: t.detach() for n, t in self.original.experts.state_dict(keep_vars=True).items()}
        rebuilt = hf_expert_tensors(self.family, self.moe.weights)
        return {rp.name: _as_released(rebuilt[rp.name], rp) for rp in self._released}

    def restore_original(self) -> torch.nn.Module:
        """The original block, with released expert parameters rebuilt into the same Parameter objects."""
        if self._released:
            rebuilt = hf_expert_tensors(self.family, self.moe.weights)
            self._fill_released({rp.name: rebuilt[rp.name] for rp in self._released})
            self._released = ()
        if self.family.hf.bias_on_block:  # this block's buffer, as loaded or moved since patching
            setattr(
                self.original, self.family.hf.correction_bias, getattr(self, self.family.hf.correction_bias)
            )
        return self.original

    def _fill_released(self, values: dict[str, torch.Tensor]) -> None:
        params = dict(self.original.experts.named_parameters())
        for rp in self._released:
            src = values[rp.name]
            dst = torch.empty_strided(rp.shape, rp.stride, dtype=rp.dtype, device=params[rp.name].device)
            params[rp.name].data = dst.copy_(src)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        if recurse:
            convert_moekit_layers_first(self, fn)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(  # noqa: ANN001 - nn.Module's signature
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        head = prefix + "experts."
        given = {k[len(head) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(head)]}
        shapes = self._expert_shapes()
        if strict:
            missing_keys.extend(head + n for n in shapes if n not in given)
        unexpected_keys.extend(head + n for n in given if n not in shapes)
        mismatched = [n for n in given if n in shapes and tuple(given[n].shape) != shapes[n]]
        error_msgs.extend(
            f"size mismatch for {head + n}: copying a param with shape {tuple(given[n].shape)} from "
            f"checkpoint, the shape in current model is {shapes[n]}."
            for n in mismatched
        )
        loadable = {n: t for n, t in given.items() if n in shapes}
        # The router's correction bias is read, not taken: the router module loads it as HF's would
        # (and reports a missing or mis-sized one); moekit's layer is rebuilt with a copy of it.
        bias_key = self.correction_bias_key(prefix)
        bias = None if bias_key is None else state_dict.get(bias_key)
        if bias is not None and tuple(bias.shape) != (self.spec.E,):
            bias = None  # the router's own load reports the size mismatch
        if (loadable and not mismatched) or bias is not None:
            self._load_experts(loadable if not mismatched else {}, correction_bias=bias)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _expert_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._released:
            return {rp.name: rp.shape for rp in self._released}
        return {n: tuple(t.shape) for n, t in self.original.experts.state_dict(keep_vars=True).items()}

    def _load_experts(
        self, values: dict[str, torch.Tensor], *, correction_bias: torch.Tensor | None = None
    ) -> None:
        """Load expert tensors (HF names) into the original experts, then rebuild `moe` from them (with
        `correction_bias`, a state dict's, if given; else the layer's own)."""
        params = dict(self.original.experts.named_parameters())
        released = self._released
        with torch.no_grad():
            if released:
                current = {} if len(values) == len(released) else self.experts_state()
                self._fill_released({rp.name: values.get(rp.name, current.get(rp.name)) for rp in released})
                backup = {}
            else:
                backup = {n: params[n].detach().clone() for n in values}
                for n, t in values.items():
                    params[n].copy_(t)
        try:
            weights = from_hf_experts(
                self.original.experts, self.family, gate_layout=self.moe.weights.gate_layout
            )
            router = getattr(self, self.family.router_name)
            if correction_bias is not None:  # the buffer's dtype, as the router (or this block) will load it
                buffer = correction_bias_of(self, self.family.hf)
                correction_bias = correction_bias.detach().to(dtype=buffer.dtype, copy=True)
            moe = FusedMoE(
                spec=self.spec,
                weights=weights,
                router_weight=router.weight,
                router_bias=getattr(router, "bias", None),
                correction_bias=self.moe.correction_bias if correction_bias is None else correction_bias,
                device=self.moe.device,
                options=self.moe.options,
                parallel=self.moe.parallel,
            )
        except BaseException:
            with torch.no_grad():
                for n, t in backup.items():
                    params[n].copy_(t)
                for rp in released:
                    params[rp.name].data = torch.empty(0, dtype=rp.dtype, device=params[rp.name].device)
            raise
        self.moe = moe
        if released:
            self._released = ()
            self.release_original()

    def extra_repr(self) -> str:
        return f"family={self.family.value}, released_original={self.released_original}"


def _state_dict_as_original(
    block: MoekitMoEBlock, state_dict: dict, prefix: str, local_metadata: dict
) -> None:
    """A patched block's entries become the original block's, in its order (router tensors kept)."""
    ours = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    experts = block.experts_state()
    original = block.original.state_dict(prefix=prefix, keep_vars=True)
    head = prefix + "experts."
    for key, value in original.items():
        if key in ours:
            state_dict[key] = ours[key]
        elif key.startswith(head) and key[len(head) :] in experts:
            state_dict[key] = experts[key[len(head) :]]
        else:
            state_dict[key] = value.detach()
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and hasattr(original, "_metadata"):
        metadata.update(original._metadata)
