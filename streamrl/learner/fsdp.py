"""FSDP2 plumbing: process group, device mesh, model loading, sharding, full-parameter gather.

Parts:
- ``init_distributed``: join (or reuse) the learner's process group; gloo on CPU, NCCL on GPU.
- ``MeshSpec`` + ``parallelize``: the one place parallelism is composed, in a fixed order
  (activation checkpointing, then ``fully_shard`` on each decoder layer, then on the root);
  ``mixed_precision`` (``learner.mixed_precision``) decides its bf16 compute.
- ``load_causal_lm`` / ``load_value_model``: HF models from a local directory, fp32 masters;
  on the meta device they build the architecture from ``config.json`` and read no weights.
- ``load_sharded``: load + ``parallelize``, the checkpoint read by rank 0 alone. With more than one
  rank, rank 0 loads the full model; the others build it on meta, shard it, allocate only their
  shards and receive them (and every buffer) by broadcast from rank 0, so no rank but 0 ever
  holds the full model. Tied embeddings stay one parameter (checked).
- ``iter_full_parameters``: unsharded HF-named parameters one at a time, for the weight bus.

FSDP2 only (``torch.distributed.fsdp.fully_shard``): FSDP1 segfaults on full-state-dict offload
on CPU (DESIGN.md §11). Parameter names are untouched by FSDP2 and by HF's gradient
checkpointing, so the names a caller sees are the HF checkpoint names vLLM loads.
Depends on torch, transformers and the weight bus's protocol (``weight_bus.base``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from streamrl.learner import varlen_attention
from streamrl.learner.swiglu import use_fused_mlp
from streamrl.weight_bus.base import NamedTensors

DEFAULT_TIMEOUT = timedelta(minutes=10)


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is a clear error."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("learner.device='cuda' but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"learner.device={device!r}: must be one of auto, cpu, cuda")
    return torch.device("cpu")


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Join the learner process group unless one is already initialised (then it must match).

    On GPU the group is ``cpu:gloo,cuda:nccl`` so CPU-side collectives (checkpoint plumbing)
    work next to NCCL ones; each rank takes GPU ``rank % device_count``.
    """
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a process group is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        return
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


@dataclass(frozen=True)
class MeshSpec:
    """The learner's parallel layout. Only data-parallel sharding (FSDP2) for now; a TP or
    SP degree would be one more field here and one more step in ``parallelize``."""

    dp_shard: int
    device_type: str = "cpu"
    mixed_precision: bool = False
    """bf16 params/activations with fp32 gradient reduction, fp32 master weights (the sharded
    parameters, hence the optimizer state); fp32 throughout otherwise. Works on CPU (gloo) as
    on GPU."""
    gradient_checkpointing: bool = False

    def build_mesh(self) -> DeviceMesh:
        if dist.get_world_size() != self.dp_shard:
            raise ValueError(
                f"MeshSpec.dp_shard={self.dp_shard} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        return init_device_mesh(self.device_type, (self.dp_shard,), mesh_dim_names=("dp",))


def mixed_precision(choice: str, device: torch.device) -> bool:
    """Whether ``learner.mixed_precision`` (auto | bf16 | fp32) means bf16 compute on
    ``device``; auto: on CUDA only (a CPU gains from bf16 only with bf16 matmul units, e.g.
    AVX512-BF16 / AMX, so a preset opts in where it measured a gain)."""
    if choice == "auto":
        return device.type == "cuda"
    if choice not in ("bf16", "fp32"):
        raise ValueError(f"learner.mixed_precision={choice!r}: must be one of auto, bf16, fp32")
    return choice == "bf16"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF model (``model.base_model.layers`` for Qwen2/Llama), also
    inside a peft (LoRA) wrapper, whose ``base_model`` is its tuner."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find decoder layers at base_model.layers")
    return layers


def parallelize(model: nn.Module, spec: MeshSpec) -> nn.Module:
    """Apply the parallelisms of ``spec`` to ``model`` in place, in this fixed order:

    1. activation checkpointing (HF's, non-reentrant; it must see the unsharded layer forward),
       the recomputed layers' SwiGLU MLPs through ``swiglu.SwiGLU`` (less held in backward),
    2. ``fully_shard`` on every decoder layer (its params are gathered just for its forward),
    3. ``fully_shard`` on the root (embeddings, final norm, head; tied weights stay together),
       resharded as soon as a backward has passed the head and final norm
       (``_reshard_root_in_backward``), not after the first decoder layer's backward.

    With ``spec.mixed_precision`` every unit gathers its parameters as bf16 copies for forward
    and backward (its layer inputs cast to bf16), reduces gradients in fp32 into the fp32
    shards, and the optimizer steps those: the model's ``parameters()`` stay fp32.
    """
    mesh = spec.build_mesh()
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        use_fused_mlp(model)  # its backward holds 2 [tokens, intermediate] tensors, not 6
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if spec.mixed_precision
        else MixedPrecisionPolicy()
    )
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = fully_shard(model, mesh=mesh, mp_policy=mp)
    layers[-1].register_forward_hook(_reshard_root_in_backward(root))
    return model


def _reshard_root_in_backward(model: FSDPModule) -> Callable[..., None]:
    """A forward hook for the last decoder layer: once a backward's gradient reaches that
    layer's output, the root unit's gathered parameters are freed.

    The root unit (embeddings, final norm, head) stays gathered from its forward to the end
    of its backward, after the first decoder layer's, but its parameters are used only by the
    final norm and head, which backward passes first: the embedding lookup's backward needs the
    token ids alone. Its gradients still accumulate on the gathered parameters, which the root's
    post-backward reduces as before. Frees the embedding (SmolLM2: 108 MiB fp32, gathered copy
    even at world size 1) for the decoder layers' backward, where the step's peak is. A model
    whose root parameters take part in backward below the decoder layers would fail loudly
    (their storage is freed), not silently."""
    def on_output(module: nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: model.reshard())

    return on_output


# fp32 masters everywhere: mixed precision casts per forward, the optimizer keeps fp32.
# Packed micro-batches attend per sequence (varlen_attention); padded ones as with sdpa.
_LOAD_KWARGS: dict[str, object] = {"dtype": torch.float32,
                                   "attn_implementation": varlen_attention.IMPLEMENTATION}

META = torch.device("meta")

ModelLoader = Callable[[str | os.PathLike[str], torch.device], nn.Module]
"""``load_causal_lm`` or ``load_value_model``: on the ``meta`` device it builds the architecture
from ``config.json`` alone and reads no weights."""


def load_causal_lm(path: str | os.PathLike[str], device: torch.device) -> nn.Module:
    """An HF causal LM from a local directory, fp32, on ``device`` (``META``: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    varlen_attention.register()
    if device == META:
        return _on_meta(AutoModelForCausalLM, AutoConfig.from_pretrained(str(path)))
    model = AutoModelForCausalLM.from_pretrained(str(path), **_LOAD_KWARGS)
    return model.to(device)


def load_value_model(path: str | os.PathLike[str], device: torch.device) -> nn.Module:
    """A causal LM backbone with a scalar head (``AutoModelForTokenClassification``,
    ``num_labels=1``, as verl's critic): the head is freshly initialised to zero so every value
    starts at 0, and the whole thing still exports as an HF model. ``META``: no weights read
    (the zero head then comes with the loading rank's state dict)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(str(path))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the head's default dropout (0.1) would make values noisy
    varlen_attention.register()
    if device == META:
        return _on_meta(AutoModelForTokenClassification, config)
    model = AutoModelForTokenClassification.from_pretrained(
        str(path), config=config, **_LOAD_KWARGS
    )
    head = model.score
    nn.init.zeros_(head.weight)
    if head.bias is not None:
        nn.init.zeros_(head.bias)
    return model.to(device)


def _on_meta(auto_class: Any, config: Any) -> nn.Module:
    """The architecture with meta tensors: no memory, no checkpoint read; ties as loaded."""
    with META:
        return auto_class.from_config(config, **_LOAD_KWARGS)


def load_sharded(
    load: ModelLoader, path: str | os.PathLike[str], device: torch.device, spec: MeshSpec
) -> nn.Module:
    """``parallelize(load(path, device), spec)``, with the checkpoint read by rank 0 only.

    World size 1 is exactly that. Otherwise rank 0 loads the full model and keeps its state
    dict (references, no copy) while ``parallelize`` shards it; the other ranks build the model
    on ``META``, shard it there and allocate only their shards (``to_empty``). Rank 0 then
    broadcasts tensor by tensor into every rank's shards (DCP's ``broadcast_from_rank0``) and
    drops the full tensors; buffers, non-persistent ones (rotary ``inv_freq``) included, are not
    in the state dict and are broadcast as they are. Peak memory: rank 0 as before, the others
    their shards plus one full tensor.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return parallelize(load(path, device), spec)
    rank0 = dist.get_rank() == 0
    model = load(path, device if rank0 else META)
    full = model.state_dict() if rank0 else {}
    parallelize(model, spec)
    if not rank0:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    del full
    _broadcast_buffers(model)
    _check_ties(model)
    return model


def _broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's buffers on every rank: ``to_empty`` left them as garbage there."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def _check_ties(model: nn.Module) -> None:
    """A tied head must still be the embedding's parameter (FSDP2 shards shared ones once)."""
    config = getattr(model, "config", None)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is None or not getattr(config, "tie_word_embeddings", False):
        return
    if output.weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{type(model).__name__}: lm_head is no longer tied to the embedding")


def iter_full_parameters(
    model: nn.Module, dtype: torch.dtype | None = None, every_rank: bool = False
) -> NamedTensors:
    """Yield ``(hf_name, full_tensor)`` one parameter at a time, on rank 0 only (every rank
    with ``every_rank``: co-located ranks each feed their own engine).

    Every rank must drive this iterable to the end (each ``full_tensor()`` is a collective);
    other ranks yield nothing. At most one gathered parameter exists beyond the shards at any
    time. Without a gather or a cast (world size 1, no cast) the tensors alias the live
    parameters: read-only views valid until the next optimizer step.
    """
    return _full_parameters(list(model.named_parameters()), dtype, every_rank)


def _full_parameters(
    params: Sequence[tuple[str, nn.Parameter]], dtype: torch.dtype | None, every_rank: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in params:
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0 or every_rank:
            yield name, full.detach().to(dtype or full.dtype)
        del full


def made_anew(param: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the full tensor yielded for ``param`` is new memory, not the live parameter."""
    if dtype is not None and dtype != param.dtype:
        return True  # the cast copies
    if not isinstance(param, DTensor):
        return False
    # Gathering a placement spread over more than one rank allocates the full tensor; over a
    # mesh dimension of size 1 (or replicated) DTensor hands back the local shard itself.
    mesh = param.device_mesh
    return any(not p.is_replicate() and mesh.size(i) > 1 for i, p in enumerate(param.placements))
