"""``mc_groups.param_attrs``: each accessor reads or writes Megatron's attribute name, reads
the documented default when the attribute is absent, and the strict read names the param.
No processes: attributes on plain tensors (and a one-rank group object for the gtp tags)."""

from __future__ import annotations

import pytest
import torch

from mc_groups import param_attrs as pa


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2, 3))


def test_absent_attributes_read_as_megatrons_defaults() -> None:
    p = _param()
    assert not pa.is_expert_param(p)
    assert not pa.is_shared_embedding(p)
    assert not pa.has_main_grad(p)
    assert pa.main_grad_or_none(p) is None
    assert not pa.has_main_grad_copy(p)
    assert not pa.has_grad_added_flag(p)
    assert not pa.zeroes_wgrad(p)
    assert not pa.is_sequence_parallel_param(p)
    assert not pa.averages_grad_across_tp(p)
    assert not pa.is_tensor_model_parallel(p)
    assert pa.partition_dim_of(p) == -1
    assert pa.partition_dim_of(p, 0) == 0
    assert pa.partition_stride_of(p) == 1
    assert not pa.is_gtp_weight_remat(p)
    assert pa.gtp_group_of(p) is None
    assert pa.gtp_remat_size_of(p) is None
    assert pa.pad_length_of(p) == 0
    assert pa.gtp_unsharded_shape_of(p) is None
    assert pa.gtp_wgrad_scale_of(p, 0.5) == 0.5
    assert pa.gtp_remat_rank_of(p) == 0
    with pytest.raises(AttributeError):
        pa.main_grad_of(p)


def test_readers_see_attributes_set_by_megatron_name() -> None:
    p = _param()
    grad = torch.ones(2, 3)
    for name, value in {
        "allreduce": False,
        "shared_embedding": True,
        "main_grad": grad,
        "main_grad_copy_in_grad_buffer": grad,
        "zero_out_wgrad": True,
        "sequence_parallel": True,
        "average_gradients_across_tp_domain": True,
        "tensor_model_parallel": True,
        "partition_dim": 1,
        "partition_stride": 2,
        "is_gtp_weight_remat": True,
        "pad_length": 3,
        "gtp_unsharded_shape": [4, 3],
        "gtp_wgrad_scale": 0.25,
        "gtp_remat_rank": 1,
    }.items():
        setattr(p, name, value)
    assert pa.is_expert_param(p)
    assert pa.is_shared_embedding(p)
    assert pa.main_grad_of(p) is grad
    assert pa.main_grad_or_none(p) is grad
    assert pa.main_grad_copy_of(p) is grad
    assert pa.zeroes_wgrad(p)
    assert pa.is_sequence_parallel_param(p)
    assert pa.averages_grad_across_tp(p)
    assert pa.is_tensor_model_parallel(p)
    assert (pa.partition_dim_of(p), pa.partition_stride_of(p)) == (1, 2)
    assert pa.is_gtp_weight_remat(p)
    assert pa.pad_length_of(p) == 3
    assert pa.gtp_unsharded_shape_of(p) == (4, 3)
    assert pa.gtp_wgrad_scale_of(p, 1.0) == 0.25
    assert pa.gtp_remat_rank_of(p) == 1


def test_writers_set_megatron_names() -> None:
    p = _param()
    grad, view = torch.ones(2, 3), torch.zeros(2, 3)
    pa.mark_allreduce(p, False)
    pa.set_main_grad(p, grad)
    pa.set_main_grad_copy(p, view)
    pa.clear_grad_added_to_main_grad(p)
    pa.mark_sequence_parallel(p, True)
    tags = vars(p)  # attributes set on a Parameter live in its __dict__
    assert tags["allreduce"] is False
    assert tags["main_grad"] is grad
    assert tags["main_grad_copy_in_grad_buffer"] is view
    assert tags["grad_added_to_main_grad"] is False
    assert tags["sequence_parallel"] is True
    assert pa.has_grad_added_flag(p)
    pa.mark_grad_added_to_main_grad(p)
    assert vars(p)["grad_added_to_main_grad"] is True
    pa.drop_main_grad_copy(p)
    pa.drop_main_grad_copy(p)  # absent: nothing to drop
    assert "main_grad_copy_in_grad_buffer" not in vars(p)


def test_bool_attr_refuses_non_bools_naming_the_param() -> None:
    p = _param()
    assert pa.bool_attr(p, pa.ALLREDUCE, True) is True
    p.allreduce = False  # type: ignore[attr-defined]
    assert pa.bool_attr(p, pa.ALLREDUCE, True) is False
    p.allreduce = 0  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"param \(shape \(2, 3\), float32\) has allreduce=0; "):
        pa.bool_attr(p, pa.ALLREDUCE, True)
    p.zero_out_wgrad = "yes"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"param 'fc\.weight' has zero_out_wgrad='yes'; the"):
        pa.bool_attr(p, pa.ZERO_OUT_WGRAD, False, "fc.weight")


def test_layer_wise_tag_is_a_strict_bool_absent_false() -> None:
    p = _param()
    assert pa.is_layer_wise_managed(p) is False
    p.is_managed_by_layer_wise_optimizer = True  # type: ignore[attr-defined]
    assert pa.is_layer_wise_managed(p) is True
    p.is_managed_by_layer_wise_optimizer = "yes"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="has is_managed_by_layer_wise_optimizer='yes'"):
        pa.is_layer_wise_managed(p)


def test_every_name_is_documented_and_exported() -> None:
    doc = pa.__doc__ or ""
    constants = {k: v for k, v in vars(pa).items() if k.isupper() and isinstance(v, str)}
    assert len(constants) == 29  # + SHARED, SUM_GRADIENTS_ACROSS_TP_DOMAIN (issue 32), MARK_RECORD
    for key, name in constants.items():
        assert f"``{name}``" in doc, name
        assert key in pa.__all__
    functions = [
        k
        for k, v in vars(pa).items()
        if callable(v) and v.__module__ == pa.__name__ and not k.startswith("_")
    ]
    assert sorted(functions) == sorted(k for k in pa.__all__ if not k.isupper())


def _swap(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """What FSDP2's ``fully_shard`` does to a param: a new Parameter object (no attributes)
    under the same name."""
    new = torch.nn.Parameter(getattr(module, name).detach().clone())
    module._parameters[name] = new
    return new


def test_marks_recorded_on_the_module_survive_a_parameter_swap() -> None:
    """The marks come back on the new parameter, per-step state does not; a mark set after
    ``record_marks`` (on the old param) is seen (the record is the live dict); the param's
    own attributes win; a second restore is a no-op."""
    linear, layer_norm = torch.nn.Linear(4, 6), torch.nn.LayerNorm(6)
    model = torch.nn.Sequential(linear, layer_norm)
    weight, norm = linear.weight, layer_norm.weight
    weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    weight.partition_dim = 0  # type: ignore[attr-defined]
    pa.set_main_grad(weight, torch.zeros(6, 4))
    pa.clear_grad_added_to_main_grad(weight)
    assert pa.record_marks(model) == 4
    pa.mark_sequence_parallel(norm, True)  # after the record: still kept
    new_weight, new_norm = _swap(linear, "weight"), _swap(layer_norm, "weight")
    new_norm.sequence_parallel = False  # type: ignore[attr-defined]  # its own value wins
    assert not pa.is_tensor_model_parallel(new_weight)
    assert pa.restore_marks(model) == 2  # the two swapped (the biases were not)
    assert pa.is_tensor_model_parallel(new_weight)
    assert pa.partition_dim_of(new_weight) == 0
    assert not pa.has_main_grad(new_weight)
    assert not pa.has_grad_added_flag(new_weight)
    assert not pa.is_sequence_parallel_param(new_norm)
    assert pa.restore_marks(model) == 0


def test_a_recorded_parameter_gone_or_reshaped_is_an_error_naming_it() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    pa.record_marks(model)
    model[0]._parameters["weight"] = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match=r"'0\.weight' has shape \(3, 4\).*\(6, 4\)"):
        pa.restore_marks(model)
    del model[0]._parameters["weight"]
    with pytest.raises(RuntimeError, match=r"'0\.weight' is gone"):
        pa.restore_marks(model)
