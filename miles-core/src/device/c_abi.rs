//! The C ABI of the PyTorch drop-in: torch_memory_saver's entry points, as C functions that
//! turn raw pointers and C strings into safe values and call a safe [`MemorySaverAbi`].
//!
//! The drop-in crate (`miles-torch`) implements [`MemorySaverAbi`] and invokes
//! [`torch_memory_saver_c_abi!`](crate::torch_memory_saver_c_abi) once at its root; the
//! macro emits the `#[unsafe(no_mangle)] extern "C"` functions that torch_memory_saver's Python
//! layer (and ours, `miles_memory_saver`) loads with ctypes, PyTorch's pluggable allocator
//! calls (`tms_torch_malloc` / `tms_torch_free`), and a process started under `LD_PRELOAD`
//! resolves `cudaMalloc` / `cudaFree` to. Every raw pointer is read here, so the drop-in
//! crate holds no `unsafe`.
//!
//! Nothing here aborts: a failure is a status (0 is success) or a null pointer, and the
//! failing call's message is what `tms_last_error` returns on the same thread.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use super::DeviceAddress;

/// `cudaSuccess`.
pub const CUDA_SUCCESS: c_int = 0;
/// `cudaErrorMemoryAllocation`: what a refused allocation returns.
pub const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
/// `cudaErrorInvalidValue`: what a failed free returns.
pub const CUDA_ERROR_INVALID_VALUE: c_int = 1;

/// What an intercepted `cudaMalloc` does.
#[derive(Debug)]
pub enum MallocOutcome {
    /// Memory of a tag, at this device address.
    Tagged(DeviceAddress),
    /// Not inside a region: the real `cudaMalloc` serves it.
    Plain,
}

/// What an intercepted `cudaFree` did.
#[derive(Debug)]
pub enum FreeOutcome {
    /// The address was memory of a tag, and is freed.
    Freed,
    /// The address is not memory of a tag: the real `cudaFree` frees it.
    NotOurs,
}

/// The drop-in's behaviour behind the C entry points, all safe; one implementation per
/// process, whose state is global (the configuration setters act on the calling thread, as
/// torch_memory_saver's do).
///
/// Errors are messages: the entry point returns a failure status and keeps the message for
/// `tms_last_error`.
pub trait MemorySaverAbi {
    /// Whether allocations on this thread go to a tag (`tms_set_interesting_region`).
    fn set_interesting_region(value: bool);
    /// See [`set_interesting_region`](Self::set_interesting_region).
    fn interesting_region() -> bool;
    /// The tag allocations on this thread go to; `None` for a NULL tag.
    ///
    /// # Errors
    /// A message when the tag is unusable.
    fn set_current_tag(tag: Option<&str>) -> Result<(), String>;
    /// See [`set_current_tag`](Self::set_current_tag).
    fn current_tag() -> String;
    /// Whether new allocations on this thread are backed up to host memory when paused.
    fn set_enable_cpu_backup(value: bool);
    /// See [`set_enable_cpu_backup`](Self::set_enable_cpu_backup).
    fn enable_cpu_backup() -> bool;
    /// The kind of host memory CPU backups use (`pinned`); `None` for NULL.
    ///
    /// # Errors
    /// A message naming the values accepted.
    fn set_cpu_backup_backend(backend: Option<&str>) -> Result<(), String>;
    /// See [`set_cpu_backup_backend`](Self::set_cpu_backup_backend).
    fn cpu_backup_backend() -> String;
    /// Whether new allocations on this thread are backed up to disk when paused.
    fn set_enable_disk_backup(value: bool);
    /// See [`set_enable_disk_backup`](Self::set_enable_disk_backup).
    fn enable_disk_backup() -> bool;
    /// The directory disk backups go to; `None` for NULL.
    ///
    /// # Errors
    /// A message when the directory cannot be used.
    fn set_disk_backup_dir(dir: Option<&str>) -> Result<(), String>;
    /// Device memory that must stay free after an allocation in a region or a resume.
    fn set_memory_margin_bytes(value: u64);
    /// Whether host backups are kept for reuse after a resume.
    fn set_retain_cpu_backup(value: bool);
    /// See [`set_retain_cpu_backup`](Self::set_retain_cpu_backup).
    fn retain_cpu_backup() -> bool;
    /// Pause `tag`, or every tag for `None`.
    ///
    /// # Errors
    /// A message; the tag keeps its bytes.
    fn pause(tag: Option<&str>) -> Result<(), String>;
    /// Resume `tag`, or every paused tag for `None`.
    ///
    /// # Errors
    /// A message; a tag that could not resume stays paused with its backup.
    fn resume(tag: Option<&str>) -> Result<(), String>;
    /// Pin now the host memory a pause of `tag`'s CPU-backed allocations copies into, so that
    /// its first pause copies instead of pinning (a miles call beyond torch_memory_saver's
    /// ABI; its Python `region()` makes it when a region with CPU backup closes).
    ///
    /// # Errors
    /// A message when the host cannot provide the memory; nothing changes then.
    fn prepare_cpu_backup(tag: &str) -> Result<(), String>;
    /// The host address of the CPU backup of the device bytes `[address, address + len)` while
    /// their tag is paused with a CPU backup; `None` otherwise.
    fn cpu_backup_address(address: DeviceAddress, len: u64) -> Option<usize>;
    /// PyTorch's pluggable allocator: `len` bytes on GPU `device` for the current region.
    ///
    /// # Errors
    /// A message; PyTorch sees an out-of-memory.
    fn torch_malloc(len: usize, device: i32) -> Result<DeviceAddress, String>;
    /// PyTorch's pluggable allocator: free what [`torch_malloc`](Self::torch_malloc) returned.
    ///
    /// # Errors
    /// A message (logged: PyTorch's free returns nothing).
    fn torch_free(address: DeviceAddress, len: usize, device: i32) -> Result<(), String>;
    /// An intercepted `cudaMalloc` of `len` bytes on the current GPU.
    ///
    /// # Errors
    /// A message; the caller sees `cudaErrorMemoryAllocation`.
    fn cuda_malloc(len: usize) -> Result<MallocOutcome, String>;
    /// An intercepted `cudaFree`.
    ///
    /// # Errors
    /// A message; the caller sees `cudaErrorInvalidValue`.
    fn cuda_free(address: DeviceAddress) -> Result<FreeOutcome, String>;
}

/// Strings handed to C callers, one slot per getter, kept per thread until the next call of
/// the same getter on that thread.
#[derive(Clone, Copy)]
#[doc(hidden)]
pub enum Held {
    /// `tms_get_current_tag`.
    Tag,
    /// `tms_get_cpu_backup_backend`.
    Backend,
    /// `tms_last_error`.
    Error,
}

thread_local! {
    static HELD: RefCell<[Option<CString>; 3]> = const { RefCell::new([None, None, None]) };
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Keep `text` in the thread's slot `slot` and return a pointer to it as a C string (NUL bytes
/// inside become `?`); valid until the next call for the same slot on this thread.
#[doc(hidden)]
pub fn hold(slot: Held, text: String) -> *const c_char {
    let text = CString::new(text.replace('\0', "?")).unwrap_or_default();
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        let kept = held[slot as usize].insert(text);
        kept.as_ptr()
    })
}

/// Record the outcome of a call for `tms_last_error`: 0 on success, else 1 with the message
/// kept.
#[doc(hidden)]
pub fn status(outcome: Result<(), String>) -> c_int {
    match outcome {
        Ok(()) => 0,
        Err(message) => {
            fail(message);
            1
        }
    }
}

/// Keep `message` as the thread's last error and log it.
#[doc(hidden)]
pub fn fail(message: String) {
    tracing::error!(%message, "miles memory saver");
    LAST_ERROR.with(|last| *last.borrow_mut() = Some(message));
}

/// The message of the thread's last failed call, or NULL when none failed; reading it clears
/// it.
#[doc(hidden)]
pub fn last_error() -> *const c_char {
    match LAST_ERROR.with(|last| last.borrow_mut().take()) {
        Some(message) => hold(Held::Error, message),
        None => std::ptr::null(),
    }
}

/// The text of a C string argument: `None` for NULL, invalid UTF-8 replaced.
///
/// # Safety
/// `text` is NULL or points to a NUL-terminated string that lives for the call.
#[doc(hidden)]
pub unsafe fn text<'a>(text: *const c_char) -> Option<Cow<'a, str>> {
    if text.is_null() {
        return None;
    }
    // SAFETY: the caller passes a live NUL-terminated string.
    Some(unsafe { CStr::from_ptr(text) }.to_string_lossy())
}

/// The body of an intercepted `cudaMalloc`.
///
/// # Safety
/// `out` is NULL or points to writable storage for one pointer.
#[doc(hidden)]
pub unsafe fn cuda_malloc<S: MemorySaverAbi>(out: *mut *mut c_void, len: usize) -> c_int {
    if out.is_null() {
        fail("cudaMalloc was given a null pointer to write the address to".to_string());
        return CUDA_ERROR_INVALID_VALUE;
    }
    match S::cuda_malloc(len) {
        Ok(MallocOutcome::Tagged(address)) => {
            // SAFETY: `out` is writable storage for one pointer (checked non-null above).
            unsafe { out.write(address as *mut c_void) };
            CUDA_SUCCESS
        }
        Ok(MallocOutcome::Plain) => match real::<RealMalloc>(c"cudaMalloc") {
            // SAFETY: the CUDA runtime's own cudaMalloc, given the caller's arguments.
            Some(real_malloc) => unsafe { real_malloc(out, len) },
            None => {
                fail(no_runtime("cudaMalloc"));
                CUDA_ERROR_MEMORY_ALLOCATION
            }
        },
        Err(message) => {
            fail(message);
            CUDA_ERROR_MEMORY_ALLOCATION
        }
    }
}

/// The body of an intercepted `cudaFree`.
///
/// # Safety
/// `address` is what the caller wants freed, as it would pass it to `cudaFree`.
#[doc(hidden)]
pub unsafe fn cuda_free<S: MemorySaverAbi>(address: *mut c_void) -> c_int {
    match S::cuda_free(address as DeviceAddress) {
        Ok(FreeOutcome::Freed) => CUDA_SUCCESS,
        Ok(FreeOutcome::NotOurs) => match real::<RealFree>(c"cudaFree") {
            // SAFETY: the CUDA runtime's own cudaFree, given the caller's argument.
            Some(real_free) => unsafe { real_free(address) },
            None => {
                fail(no_runtime("cudaFree"));
                CUDA_ERROR_INVALID_VALUE
            }
        },
        Err(message) => {
            fail(message);
            CUDA_ERROR_INVALID_VALUE
        }
    }
}

fn no_runtime(call: &str) -> String {
    format!(
        "{call}: no cuda runtime (libcudart) is loaded after the miles memory saver; load it through LD_PRELOAD only in a process that uses the cuda runtime"
    )
}

type RealMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type RealFree = unsafe extern "C" fn(*mut c_void) -> c_int;

/// The next definition of `name` after this library (the CUDA runtime's), looked up once.
fn real<F: RealFunction>(name: &'static CStr) -> Option<F> {
    let address = *F::cache().get_or_init(|| {
        // SAFETY: dlsym with RTLD_NEXT only reads the loaded objects' symbol tables; `name` is
        // a NUL-terminated static string.
        unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
    });
    (address != 0).then(|| F::from_address(address))
}

trait RealFunction: Sized {
    fn cache() -> &'static OnceLock<usize>;
    fn from_address(address: usize) -> Self;
}

impl RealFunction for RealMalloc {
    fn cache() -> &'static OnceLock<usize> {
        static CACHE: OnceLock<usize> = OnceLock::new();
        &CACHE
    }

    fn from_address(address: usize) -> RealMalloc {
        // SAFETY: `address` is the non-null address of the CUDA runtime's
        // `cudaError_t cudaMalloc(void **, size_t)`, whose C signature this type spells.
        unsafe { std::mem::transmute::<usize, RealMalloc>(address) }
    }
}

impl RealFunction for RealFree {
    fn cache() -> &'static OnceLock<usize> {
        static CACHE: OnceLock<usize> = OnceLock::new();
        &CACHE
    }

    fn from_address(address: usize) -> RealFree {
        // SAFETY: `address` is the non-null address of the CUDA runtime's
        // `cudaError_t cudaFree(void *)`, whose C signature this type spells.
        unsafe { std::mem::transmute::<usize, RealFree>(address) }
    }
}

/// Emit torch_memory_saver's C entry points for `$saver`, an implementation of
/// [`MemorySaverAbi`](crate::device::c_abi::MemorySaverAbi). Invoke once, at the root of a
/// `cdylib`.
#[macro_export]
macro_rules! torch_memory_saver_c_abi {
    ($saver:ty) => {
        use $crate::device::c_abi as __tms_abi;
        use $crate::device::c_abi::MemorySaverAbi as _;

        /// Whether allocations on this thread go to the current tag.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_set_interesting_region(value: bool) {
            <$saver>::set_interesting_region(value)
        }

        /// Whether allocations on this thread go to the current tag.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_interesting_region() -> bool {
            <$saver>::interesting_region()
        }

        /// Set the tag allocations on this thread go to; 0 on success.
        ///
        /// # Safety
        /// `tag` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_set_current_tag(
            tag: *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let tag = unsafe { __tms_abi::text(tag) };
            __tms_abi::status(<$saver>::set_current_tag(tag.as_deref()))
        }

        /// The tag allocations on this thread go to (valid until the next call on the thread).
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_current_tag() -> *const ::std::ffi::c_char {
            __tms_abi::hold(__tms_abi::Held::Tag, <$saver>::current_tag())
        }

        /// Whether new allocations on this thread get a CPU backup.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_set_enable_cpu_backup(value: bool) {
            <$saver>::set_enable_cpu_backup(value)
        }

        /// Whether new allocations on this thread get a CPU backup.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_enable_cpu_backup() -> bool {
            <$saver>::enable_cpu_backup()
        }

        /// Set the kind of host memory of CPU backups; 0 on success.
        ///
        /// # Safety
        /// `backend` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_set_cpu_backup_backend(
            backend: *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let backend = unsafe { __tms_abi::text(backend) };
            __tms_abi::status(<$saver>::set_cpu_backup_backend(backend.as_deref()))
        }

        /// The kind of host memory of CPU backups (valid until the next call on the thread).
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_cpu_backup_backend() -> *const ::std::ffi::c_char {
            __tms_abi::hold(__tms_abi::Held::Backend, <$saver>::cpu_backup_backend())
        }

        /// Whether new allocations on this thread get a disk backup.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_set_enable_disk_backup(value: bool) {
            <$saver>::set_enable_disk_backup(value)
        }

        /// Whether new allocations on this thread get a disk backup.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_enable_disk_backup() -> bool {
            <$saver>::enable_disk_backup()
        }

        /// Set the directory of disk backups; 0 on success.
        ///
        /// # Safety
        /// `dir` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_set_disk_backup_dir(
            dir: *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let dir = unsafe { __tms_abi::text(dir) };
            __tms_abi::status(<$saver>::set_disk_backup_dir(dir.as_deref()))
        }

        /// Device memory that must stay free after an allocation in a region or a resume.
        #[unsafe(no_mangle)]
        pub extern "C" fn set_memory_margin_bytes(value: u64) {
            <$saver>::set_memory_margin_bytes(value)
        }

        /// Whether CPU backups are kept after a resume.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_set_retain_cpu_backup(value: bool) {
            <$saver>::set_retain_cpu_backup(value)
        }

        /// Whether CPU backups are kept after a resume.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_retain_cpu_backup() -> bool {
            <$saver>::retain_cpu_backup()
        }

        /// Pause `tag` (NULL: every tag); 0 on success, else see `tms_last_error`.
        ///
        /// # Safety
        /// `tag` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_pause(tag: *const ::std::ffi::c_char) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let tag = unsafe { __tms_abi::text(tag) };
            __tms_abi::status(<$saver>::pause(tag.as_deref().filter(|t| !t.is_empty())))
        }

        /// Resume `tag` (NULL: every paused tag); 0 on success, else see `tms_last_error`.
        ///
        /// # Safety
        /// `tag` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_resume(tag: *const ::std::ffi::c_char) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let tag = unsafe { __tms_abi::text(tag) };
            __tms_abi::status(<$saver>::resume(tag.as_deref().filter(|t| !t.is_empty())))
        }

        /// Pin the host memory of `tag`'s CPU backup now; 0 on success, else see
        /// `tms_last_error`.
        ///
        /// # Safety
        /// `tag` is NULL or a NUL-terminated string.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn tms_prepare_cpu_backup(
            tag: *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            // SAFETY: the caller passes NULL or a live NUL-terminated string.
            let tag = unsafe { __tms_abi::text(tag) };
            __tms_abi::status(match tag.as_deref() {
                Some(tag) if !tag.is_empty() => <$saver>::prepare_cpu_backup(tag),
                _ => Err("tms_prepare_cpu_backup needs a tag".to_string()),
            })
        }

        /// The host address of the CPU backup of `[gpu_ptr, gpu_ptr + size)`, or NULL.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_get_cpu_backup_pointer(gpu_ptr: *const u8, size: u64) -> *mut u8 {
            match <$saver>::cpu_backup_address(gpu_ptr as u64, size) {
                Some(address) => address as *mut u8,
                None => ::std::ptr::null_mut(),
            }
        }

        /// The message of this thread's last failed call (NULL if none); reading clears it.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_last_error() -> *const ::std::ffi::c_char {
            __tms_abi::last_error()
        }

        /// PyTorch's pluggable allocator: `size` bytes on GPU `device`; NULL when refused.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_torch_malloc(
            size: isize,
            device: ::std::ffi::c_int,
            _stream: *mut ::std::ffi::c_void,
        ) -> *mut ::std::ffi::c_void {
            match <$saver>::torch_malloc(size.max(0) as usize, device) {
                Ok(address) => address as *mut ::std::ffi::c_void,
                Err(message) => {
                    __tms_abi::fail(message);
                    ::std::ptr::null_mut()
                }
            }
        }

        /// PyTorch's pluggable allocator: free what `tms_torch_malloc` returned.
        #[unsafe(no_mangle)]
        pub extern "C" fn tms_torch_free(
            ptr: *mut ::std::ffi::c_void,
            size: isize,
            device: ::std::ffi::c_int,
            _stream: *mut ::std::ffi::c_void,
        ) {
            if let Err(message) = <$saver>::torch_free(ptr as u64, size.max(0) as usize, device) {
                __tms_abi::fail(message);
            }
        }

        /// `cudaMalloc` under `LD_PRELOAD`: a tag's memory inside a region, else the runtime's.
        ///
        /// # Safety
        /// As the CUDA runtime's `cudaMalloc`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn cudaMalloc(
            ptr: *mut *mut ::std::ffi::c_void,
            size: usize,
        ) -> ::std::ffi::c_int {
            // SAFETY: the caller passes what it would pass the CUDA runtime's cudaMalloc.
            unsafe { __tms_abi::cuda_malloc::<$saver>(ptr, size) }
        }

        /// `cudaFree` under `LD_PRELOAD`: a tag's memory is freed here, the rest by the runtime.
        ///
        /// # Safety
        /// As the CUDA runtime's `cudaFree`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn cudaFree(ptr: *mut ::std::ffi::c_void) -> ::std::ffi::c_int {
            // SAFETY: the caller passes what it would pass the CUDA runtime's cudaFree.
            unsafe { __tms_abi::cuda_free::<$saver>(ptr) }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_strings_stay_until_their_slot_is_reused_and_errors_clear_on_read() {
        let tag = hold(Held::Tag, "weights".to_string());
        let backend = hold(Held::Backend, "pinned".to_string());
        // SAFETY: `hold` returned pointers to live NUL-terminated strings of this thread.
        let read = |p| unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
        assert_eq!(read(tag), "weights");
        assert_eq!(read(backend), "pinned");
        assert!(last_error().is_null());
        assert_eq!(status(Err("cannot pause kv_cache".to_string())), 1);
        assert_eq!(read(last_error()), "cannot pause kv_cache");
        assert!(last_error().is_null(), "reading the last error clears it");
        assert_eq!(status(Ok(())), 0);
    }

    #[test]
    fn text_reads_null_as_none_and_replaces_invalid_utf8() {
        // SAFETY: NULL and live NUL-terminated literals.
        unsafe {
            assert_eq!(text(std::ptr::null()), None);
            assert_eq!(text(c"kv_cache".as_ptr()).as_deref(), Some("kv_cache"));
            assert_eq!(text(c"a\xffb".as_ptr()).as_deref(), Some("a\u{fffd}b"));
        }
    }
}
