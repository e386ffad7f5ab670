//! Megatron-style training backend of miles: tensor-parallel shards, contiguous parameter and
//! gradient buffers, a distributed optimizer, and `offload(target)` through the core memory manager.
#![forbid(unsafe_code)]
