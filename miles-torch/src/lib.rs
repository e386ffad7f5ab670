//! The PyTorch drop-in of miles: torch_memory_saver's C ABI on the miles memory manager.
//!
//! Built as a `cdylib`, this crate is the native half of the `miles_memory_saver` Python
//! package (`python/miles_memory_saver`), which keeps torch_memory_saver's public API, so that
//! `import miles_memory_saver as torch_memory_saver` is the only change a program needs. The
//! library exports the functions torch_memory_saver's Python layer calls (the `tms_*`
//! configuration, `tms_pause` / `tms_resume` returning a status, `tms_get_cpu_backup_pointer`),
//! PyTorch's pluggable-allocator pair `tms_torch_malloc` / `tms_torch_free` for hook mode
//! `torch`, and `cudaMalloc` / `cudaFree` for hook mode `preload` (`LD_PRELOAD`); the entry
//! points themselves live in `miles_core::device::c_abi`, which holds every raw pointer.
//!
//! What differs from torch_memory_saver: each tag owns its address arenas (one region per tag
//! and backup policy of the memory manager), so pausing one tag never touches another's
//! memory; CPU backups go to a pool of pinned host memory that is reused across cycles, and
//! copies run chunked over several streams; disk backups are checksummed chunk files; a pause
//! waits for the GPU to be idle; and no error ends the process: pause and resume return a
//! status, `tms_last_error` says why, and a resume that lacks memory changes nothing.

#![deny(unsafe_code)]

mod abi;
pub mod config;
mod error;
pub mod saver;

pub use abi::Abi;
pub use error::TorchError;
pub use saver::{Opened, Opener, Saver, SaverSettings, open_cuda};

miles_core::torch_memory_saver_c_abi!(crate::Abi);
