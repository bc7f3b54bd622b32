"""What runs inside vLLM's worker process: the weight-sync extension of its worker and a model loader.

`WeightSync` is passed to vLLM as `worker_extension_cls`: vLLM adds it to its worker class, so its
methods are reachable with `collective_rpc("hybridrl_...")` from the engine's owner (our rank). It
copies published tensors (HF names) into the live parameters in place with the model's own
`load_weights` (the weight loaders that fill fused q/k/v and gate/up parameters), then, given the
sender's digests, hashes its own storage of each tensor and returns the digests: the owner compares
them and counts only the matching tensors as arrived.

Reading back needs to know where each HF tensor lives in vLLM's parameters: the whole of a
parameter, or a block of rows of a fused one (`packed_modules_mapping` and the fused layer's
`output_sizes`, with one tensor-parallel rank). `hybridrl_layout` finds it once for every name of
the checkpoint and refuses a model whose layout it does not know.

On CPU vLLM packs each linear layer's weight into a kernel-specific copy after loading and drops the
original (`dispatch_cpu_unquantized_gemm`), so a copy into the parameter would never reach the
kernel. The loader registered here (`PLAIN_CPU_LOAD_FORMAT`) loads like vLLM's default loader but
sets vLLM's own `_cpu_skip_gemm_dispatch` on linear layers and gives the embedding / LM-head layers a
plain `torch.nn.functional.linear`: the forward then reads the parameters the copies write to, as it
does on CUDA.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from hybridrl.backends.vllm.config import PLAIN_CPU_LOAD_FORMAT
from hybridrl.publication.digest import tensor_digests

Region = tuple[str, int, int]       # (vLLM parameter name, first row, end row); rows -1, -1: the whole parameter


@register_model_loader(PLAIN_CPU_LOAD_FORMAT)
class PlainWeightsLoader(DefaultModelLoader):
    """vLLM's default loader, leaving every weight as the plain parameter the forward reads (CPU)."""

    def __init__(self, load_config: Any):
        load_config = copy.copy(load_config)
        load_config.load_format = "auto"             # the default loader picks the checkpoint files by it
        super().__init__(load_config)

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        from vllm.model_executor.layers.linear import LinearBase

        for module in model.modules():
            if isinstance(module, LinearBase):
                module._cpu_skip_gemm_dispatch = True     # read by vLLM's process_weights_after_loading
        super().load_weights(model, model_config)

    def load_model(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        model = super().load_model(*args, **kwargs)
        for module in model.modules():
            if hasattr(module, "cpu_linear"):              # embedding / LM head: a packed copy of the weight
                module.cpu_linear = torch.nn.functional.linear
        return model


class WeightSync:
    """Mixed into vLLM's worker class (`worker_extension_cls`): in-place loads, read back, the layout."""

    def _hybridrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def hybridrl_layout(self, names: Sequence[str], tied: bool) -> dict[str, tuple[tuple[int, ...], str]]:
        """Where each checkpoint tensor lives (kept for the read-backs); returns {name: (shape, dtype)} of
        those the model holds (a tied LM head is the embedding's: left out). Raises naming what it cannot place."""
        model = self._hybridrl_model()
        params = dict(model.named_parameters())
        packed = dict(getattr(type(model), "packed_modules_mapping", None) or {})
        regions: dict[str, Region] = {}
        unplaced = []
        for name in names:
            region = _locate(model, params, packed, name)
            if region is None:
                if not (tied and name == "lm_head.weight"):
                    unplaced.append(name)
                continue
            regions[name] = region
        if unplaced:
            raise ValueError(f"the vLLM model {type(model).__name__} holds no parameter for {len(unplaced)} checkpoint "
                             f"tensor(s): {unplaced[:5]}")
        self._hybridrl_regions = regions
        return {n: (tuple(self.hybridrl_storage(n).shape), str(params[r[0]].dtype).replace("torch.", ""))
                for n, r in regions.items()}

    def hybridrl_storage(self, name: str) -> torch.Tensor:
        """The engine's own storage of HF tensor `name` (a view into its parameter)."""
        param_name, start, end = self._hybridrl_regions[name]
        param = self._hybridrl_model().get_parameter(param_name)
        return param.data if start < 0 else param.data[start:end]

    def hybridrl_copy(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the live parameters in place, through the model's weight loaders."""
        with torch.no_grad():
            self._hybridrl_model().load_weights(iter(items))

    def hybridrl_load(self, wire: list[tuple[str, list[int], str, bytes]], verify: bool) -> dict[str, str] | None:
        """Load tensors sent as (name, shape, dtype, bytes); with `verify`, the digest of each one read back
        from this worker's storage."""
        return self._hybridrl_load([(n, _from_bytes(data, dtype, shape)) for n, shape, dtype, data in wire], verify)

    def hybridrl_load_bucket(self, encoding: str, buffer: bytes, entries: list[tuple[str, list[int], str, int, int]],
                             names: list[str], verify: bool) -> dict[str, str] | None:
        """One flat bucket: `buffer` is its bytes (`encoding` "raw") or a pickled CUDA IPC handle of the owner's
        buffer ("cuda_ipc"), `entries` (name, shape, dtype, start, end) its layout; `names` are loaded."""
        if encoding == "cuda_ipc":
            import pickle

            from hybridrl.backends.vllm.ipc import open_handle

            flat = open_handle(pickle.loads(buffer))       # the GPU by UUID: it is cuda:0 here, cuda:k there
        elif encoding == "raw":
            flat = torch.frombuffer(bytearray(buffer), dtype=torch.uint8)
        else:
            raise ValueError(f"unknown bucket encoding {encoding!r}")
        views = {name: flat[start:end].view(getattr(torch, dtype)).view(shape)
                 for name, shape, dtype, start, end in entries}
        digests = self._hybridrl_load([(n, views[n]) for n in names], verify)
        if encoding == "cuda_ipc":
            # the copies are queued on this worker's stream; the sender reuses its buffer for the next bucket
            # as soon as this call returns
            torch.cuda.current_stream().synchronize()
        return digests

    def _hybridrl_load(self, items: list[tuple[str, torch.Tensor]], verify: bool) -> dict[str, str] | None:
        self.hybridrl_copy(items)
        if not verify:
            return None
        return tensor_digests([(n, self.hybridrl_storage(n)) for n, _ in items])


def _from_bytes(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    if not data:
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(tuple(shape))


def _locate(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], packed: dict[str, list[str]],
            name: str) -> Region | None:
    """The vLLM parameter (and rows) holding HF tensor `name`, or None."""
    if name in params:
        return (name, -1, -1)
    module_path, _, attr = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    for fused, parts in packed.items():
        if leaf not in parts:
            continue
        fused_name = f"{parent}.{fused}" if parent else fused
        if f"{fused_name}.{attr}" not in params:
            continue
        layer = model.get_submodule(fused_name)
        if getattr(layer, "tp_size", 1) != 1:
            raise ValueError(f"reading back '{name}' needs tensor-parallel size 1 (got {layer.tp_size})")
        sizes = list(layer.output_sizes)
        index = parts.index(leaf)
        start = sum(sizes[:index])
        return (f"{fused_name}.{attr}", start, start + sizes[index])
    return None
