//! Rollout engine of miles: model weights under tag `weights`, a paged KV cache under `kv_cache`,
//! batched sampling, and the `InferenceController` the colocated loop drives.
#![forbid(unsafe_code)]
