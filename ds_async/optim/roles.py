"""What each parameter is in the model, for optimizers that treat parameters differently (Muon on hidden matrices,
AdamW on the rest).

Roles come from module types, never from parameter names: a layer that knows better declares
``ds_async_roles() -> {parameter: role}`` for its own parameters (the pipeline's LM-head layer says which Linear is
the head); otherwise an ``nn.Embedding`` weight is ``embedding``, a ``nn.Linear`` weight is ``matrix``, a 3-D
tensor is a stack of matrices (``[experts, rows, cols]``) and so ``matrix``, and every 1-D tensor (norm weights,
biases) is ``vector``. Anything else is refused, so that a new kind of layer is classified on purpose.

Some matrices are two matrices stored as one: :func:`fused_gate_up` lists the ``[gate; up]`` stacks (transformers'
``MixtralExperts.gate_up_proj``, or what a layer declares with ``ds_async_gate_up() -> [parameter, ...]``), so that
Muon can orthogonalise their halves separately (``muon_param_groups(split_gate_up=True)``). Their role stays
``matrix``.
"""
from __future__ import annotations

from torch import nn

ROLES = ("matrix", "embedding", "head", "vector")

# Types whose >= 2-D weights are not matrices in Muon's sense (convolution kernels): refuse rather than guess.
_NOT_MATRICES = (nn.modules.conv._ConvNd,)


def _by_type(module: nn.Module, name: str, param: nn.Parameter) -> str:
    if param.ndim == 1:
        return "vector"
    if isinstance(module, nn.Embedding) and param is module.weight:
        return "embedding"
    if isinstance(module, nn.Linear) and param is module.weight:
        return "matrix"
    if param.ndim == 3 and not isinstance(module, _NOT_MATRICES):
        return "matrix"
    raise ValueError(
        f"param_roles: no role for {type(module).__name__}.{name} of shape {tuple(param.shape)}; give the layer "
        f"a ds_async_roles() method returning {{parameter: role}} with role in {list(ROLES)}")


def param_roles(module: nn.Module) -> dict[nn.Parameter, str]:
    """The role of every parameter of ``module`` (see the module docstring); declared roles win over types.

    Raises if a declared role is unknown or two declarations disagree (e.g. a tied embedding and head).
    """
    roles: dict[nn.Parameter, str] = {}
    for sub in module.modules():
        declare = getattr(sub, "ds_async_roles", None)
        if declare is None:
            continue
        for param, role in declare().items():
            if role not in ROLES:
                raise ValueError(f"{type(sub).__name__}.ds_async_roles: unknown role {role!r}; roles: {list(ROLES)}")
            if roles.setdefault(param, role) != role:
                raise ValueError(f"{type(sub).__name__}.ds_async_roles: a parameter of shape {tuple(param.shape)} "
                                 f"is declared both {roles[param]!r} and {role!r} (tied weights?)")
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if param not in roles:
                roles[param] = _by_type(sub, name, param)
    return roles


def role_groups(module: nn.Module, only_trainable: bool = True) -> dict[str, list[nn.Parameter]]:
    """Parameters of ``module`` by role (in module order), every parameter in exactly one role."""
    roles = param_roles(module)
    groups: dict[str, list[nn.Parameter]] = {role: [] for role in ROLES}
    for param in dict.fromkeys(module.parameters()):  # module order, shared parameters once
        if param.requires_grad or not only_trainable:
            groups[roles[param]].append(param)
    placed = [id(p) for ps in groups.values() for p in ps]
    assert len(placed) == len(set(placed)), "a parameter landed in two role groups"
    return groups


def _fused_by_type(module: nn.Module) -> list[nn.Parameter]:
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:  # a transformers without it stores experts as separate Linears: nothing is fused
        return []
    # MixtralExperts.forward: linear(x, gate_up_proj[e]).chunk(2, dim=-1) -> gate, up: gate rows first.
    return [module.gate_up_proj] if isinstance(module, MixtralExperts) else []


def fused_gate_up(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` (in module order) each of whose matrices (last two dimensions; leading ones a
    stack of experts) is a gated MLP's gate rows followed by its up rows, in two equal halves, applied as two
    separate linear maps: transformers' ``MixtralExperts.gate_up_proj`` ``[E, 2I, H]``, and what a layer declares
    with ``ds_async_gate_up()``. Raises if one is not a ``matrix`` by :func:`param_roles` or has an odd number of
    rows."""
    roles = param_roles(module)
    found: dict[nn.Parameter, None] = {}
    for sub in module.modules():
        declare = getattr(sub, "ds_async_gate_up", None)
        for param in [*(declare() if declare is not None else ()), *_fused_by_type(sub)]:
            if roles.get(param) != "matrix" or param.shape[-2] % 2:
                raise ValueError(f"{type(sub).__name__}: a fused [gate; up] parameter of shape {tuple(param.shape)} "
                                 f"must be a matrix (role {roles.get(param)!r}) with an even number of rows")
            found[param] = None
    order = {p: i for i, p in enumerate(dict.fromkeys(module.parameters()))}
    return sorted(found, key=lambda p: order[p])
