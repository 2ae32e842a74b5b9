"""Every use of a private torch name lives in this package, so a torch upgrade touches it only.

Covered torch range: 2.11 to 2.14 (`version.SUPPORTED`, pyproject.toml), refused outside it on
import. Where releases differ, `version.at_least` decides, read only by the module wrapping that
part of torch. One module per part of torch wrapped:
`pipelining` (the schedule runtime, stages, split backward), `fsdp` (FSDP2's parameter groups),
`distributed` (c10d: store, group timeouts), `checkpoint` (DCP), `compile` (dynamo, inductor,
traced graphs), `tensors` (storages, versions, views, the CPU flash kernel) and `pytree`. Each
private name is reached behind a function named for what it does; import them from here
(`from lightning_zeropp.core._torch_private import X`), which re-exports every module's names.
`tests/unit/test_private_names.py` fails when a private torch name appears anywhere else.
"""

from __future__ import annotations

# First: a release outside the range is refused before any private name below is looked up (a
# missing one would fail with an ImportError naming it, not the release).
from lightning_zeropp.core._torch_private.version import (  # isort: skip
    SUPPORTED_RANGE,
    at_least,
    require_supported_torch,
)

require_supported_torch()

from lightning_zeropp.core._torch_private.checkpoint import (  # noqa: E402
    dcp_write_prefix,
    dcp_written_files,
    is_dcp_metadata_global,
)
from lightning_zeropp.core._torch_private.compile import (  # noqa: E402
    aot_eager,
    compile_errors,
    compile_split_graph,
    inductor,
    keep_graph_compatible_backward,
    set_compile_threads,
    split_graph,
    traced_dtype_checks,
)
from lightning_zeropp.core._torch_private.distributed import (  # noqa: E402
    default_store,
    flatten_mesh,
    group_timeout,
    mesh_group_options,
)
from lightning_zeropp.core._torch_private.fsdp import (  # noqa: E402
    defer_post_forward_reshard,
    fill_missing_gradients,
    fsdp_pre_backward_muted,
    fsdp_unit_shards,
    hide_post_forward_mesh,
    is_gathered,
    offload_policies,
    post_forward_mesh,
    release_to_post_forward_copy,
    run_post_backward,
    unsharded_gradient_bytes,
    unsharded_parameter_bytes,
    unsharded_params,
)
from lightning_zeropp.core._torch_private.pipelining import (  # noqa: E402
    Action,
    PipelineSchedule,
    ScheduleRuntime,
    ShapeInferenceStage,
    add_reduce_grad,
    add_send_recv,
    on_scheduled_loss,
    runtime_has_backward,
    runtime_microbatches,
    runtime_num_stages,
    runtime_stages,
    set_runtime_has_backward,
    stage_backward_input,
    stage_backward_weight,
    wait_gathered,
)
from lightning_zeropp.core._torch_private.pytree import (  # noqa: E402
    TreeSpec,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from lightning_zeropp.core._torch_private.tensors import (  # noqa: E402
    TorchDispatchMode,
    flash_attention_backward,
    flash_attention_lse,
    fused_attention,
    fused_attention_flops,
    is_fused_attention,
    local_chunk,
    make_subclass,
    storage_identity,
    tensor_version,
    view_base,
    will_backward_reach,
)

__all__ = [
    "SUPPORTED_RANGE",
    "Action",
    "PipelineSchedule",
    "ScheduleRuntime",
    "ShapeInferenceStage",
    "TorchDispatchMode",
    "TreeSpec",
    "add_reduce_grad",
    "add_send_recv",
    "aot_eager",
    "at_least",
    "compile_errors",
    "compile_split_graph",
    "dcp_write_prefix",
    "dcp_written_files",
    "default_store",
    "flatten_mesh",
    "defer_post_forward_reshard",
    "fill_missing_gradients",
    "fsdp_pre_backward_muted",
    "fsdp_unit_shards",
    "fused_attention",
    "fused_attention_flops",
    "group_timeout",
    "is_fused_attention",
    "flash_attention_backward",
    "flash_attention_lse",
    "hide_post_forward_mesh",
    "inductor",
    "is_dcp_metadata_global",
    "is_gathered",
    "keep_graph_compatible_backward",
    "local_chunk",
    "make_subclass",
    "mesh_group_options",
    "offload_policies",
    "on_scheduled_loss",
    "post_forward_mesh",
    "release_to_post_forward_copy",
    "run_post_backward",
    "runtime_has_backward",
    "runtime_microbatches",
    "runtime_num_stages",
    "runtime_stages",
    "set_compile_threads",
    "set_runtime_has_backward",
    "split_graph",
    "stage_backward_input",
    "stage_backward_weight",
    "storage_identity",
    "tensor_version",
    "traced_dtype_checks",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "unsharded_gradient_bytes",
    "unsharded_parameter_bytes",
    "unsharded_params",
    "view_base",
    "will_backward_reach",
    "wait_gathered",
]
