//! FSDP-style training backend of miles: every parameter sharded across data-parallel ranks in flat
//! units; its native CPU offload yields to core offload when `--offload-train` is on.
#![forbid(unsafe_code)]
