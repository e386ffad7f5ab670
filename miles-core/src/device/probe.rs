//! What this machine offers: CPU cores and memory, the CUDA driver and its GPUs, NCCL, and the
//! filesystem under a directory.
//!
//! The CUDA driver and NCCL are probed with `libloading` before anything touches cudarc, which
//! panics when a library or symbol is missing. Every probe returns an error instead of panicking,
//! so `miles doctor` and `--device auto` work on any machine.

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use serde::Serialize;

use super::DeviceError;

/// Names tried, in order, for the CUDA driver library.
const CUDA_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];
/// Names tried, in order, for NCCL.
const NCCL_LIBRARIES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
/// `CUDA_ERROR_NO_DEVICE`: the driver loads but sees no GPU.
const CUDA_ERROR_NO_DEVICE: c_int = 100;
/// `TMPFS_MAGIC` of `statfs(2)`.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Everything [`probe`] found, each part probed independently.
#[derive(Debug)]
pub struct Probe {
    /// CPU cores and memory.
    pub host: Result<HostInfo, DeviceError>,
    /// The CUDA driver and its GPUs.
    pub cuda: Result<CudaProbe, DeviceError>,
    /// NCCL.
    pub nccl: Result<NcclProbe, DeviceError>,
    /// The filesystem under the directory asked about, if one was.
    pub disk: Option<(PathBuf, Result<FsStats, DeviceError>)>,
}

/// Probes the host, the CUDA driver, NCCL and (when given) the filesystem under `disk_dir`.
///
/// Never panics: each part that cannot be probed carries its error.
pub fn probe(disk_dir: Option<&Path>) -> Probe {
    Probe {
        host: host_info(),
        cuda: probe_cuda(),
        nccl: probe_nccl(),
        disk: disk_dir.map(|dir| (dir.to_path_buf(), filesystem(dir))),
    }
}

/// CPU cores and memory of the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HostInfo {
    /// Cores this process may run on.
    pub cpu_cores: usize,
    /// `MemTotal` of /proc/meminfo, in bytes.
    pub memory_total_bytes: u64,
    /// `MemAvailable` of /proc/meminfo, in bytes.
    pub memory_available_bytes: u64,
}

/// Reads the CPU cores available to this process and the memory of /proc/meminfo.
///
/// # Errors
/// [`DeviceError::Os`] when /proc/meminfo cannot be read or lacks `MemTotal` / `MemAvailable`.
pub fn host_info() -> Result<HostInfo, DeviceError> {
    let cpu_cores = std::thread::available_parallelism()
        .map_err(|source| DeviceError::Os {
            call: "available_parallelism",
            source,
        })?
        .get();
    let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(|source| DeviceError::Os {
        call: "read /proc/meminfo",
        source,
    })?;
    let field = |name: &str| -> Result<u64, DeviceError> {
        meminfo_kib(&meminfo, name)
            .map(|kib| kib * 1024)
            .ok_or_else(|| DeviceError::Os {
                call: "read /proc/meminfo",
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("no `{name}` line"),
                ),
            })
    };
    Ok(HostInfo {
        cpu_cores,
        memory_total_bytes: field("MemTotal")?,
        memory_available_bytes: field("MemAvailable")?,
    })
}

/// The value in KiB of the /proc/meminfo line `name:   N kB`.
fn meminfo_kib(meminfo: &str, name: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The CUDA driver as the probe found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CudaProbe {
    /// The library that loaded (`libcuda.so.1`, say).
    pub library: String,
    /// The driver's CUDA version as `cuDriverGetVersion` reports it (13000 for CUDA 13.0).
    pub driver_version: i32,
    /// The GPUs the driver sees; empty when it sees none.
    pub gpus: Vec<GpuInfo>,
}

impl CudaProbe {
    /// The driver's CUDA version as `major.minor`.
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// One GPU the driver sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: i32,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory_bytes: u64,
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type CuGetErrorString = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// Loads the CUDA driver, initialises it and lists its GPUs.
///
/// # Errors
/// [`DeviceError::CudaUnavailable`] when no driver library loads or lacks a symbol (of those
/// this probe calls, or of those the CUDA device calls through cudarc);
/// [`DeviceError::Cuda`] when a driver call fails (other than "no device", which yields no GPUs).
pub fn probe_cuda() -> Result<CudaProbe, DeviceError> {
    cudarc_driver_ready().map_err(DeviceError::CudaUnavailable)?;
    let (library, name) = open_first(&CUDA_LIBRARIES).map_err(DeviceError::CudaUnavailable)?;
    let cu_init: CuInit = symbol(&library, name, "cuInit")?;
    let cu_driver_get_version: CuIntOut = symbol(&library, name, "cuDriverGetVersion")?;
    let cu_device_get_count: CuIntOut = symbol(&library, name, "cuDeviceGetCount")?;
    let cu_device_get: CuDeviceGet = symbol(&library, name, "cuDeviceGet")?;
    let cu_device_get_name: CuDeviceGetName = symbol(&library, name, "cuDeviceGetName")?;
    let cu_device_total_mem: CuDeviceTotalMem = symbol(&library, name, "cuDeviceTotalMem_v2")?;
    let cu_get_error_string: CuGetErrorString = symbol(&library, name, "cuGetErrorString")?;
    let check = |call: &'static str, code: c_int| -> Result<(), DeviceError> {
        if code == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null) for any
        // code; `text` is a valid out-pointer.
        let known = unsafe { cu_get_error_string(code, &mut text) } == 0 && !text.is_null();
        let message = if known {
            // SAFETY: the driver returned a NUL-terminated static string.
            let text = unsafe { CStr::from_ptr(text) };
            format!("{} (code {code})", text.to_string_lossy())
        } else {
            format!("code {code}")
        };
        Err(DeviceError::Cuda { call, message })
    };

    let mut driver_version: c_int = 0;
    // SAFETY: the out-pointer is valid; cuDriverGetVersion may be called before cuInit.
    check("cuDriverGetVersion", unsafe {
        cu_driver_get_version(&mut driver_version)
    })?;
    // SAFETY: cuInit takes flags 0 and no pointers.
    let init = unsafe { cu_init(0) };
    let mut gpus = Vec::new();
    if init != CUDA_ERROR_NO_DEVICE {
        check("cuInit", init)?;
        let mut count: c_int = 0;
        // SAFETY: the driver is initialised and the out-pointer is valid.
        check("cuDeviceGetCount", unsafe {
            cu_device_get_count(&mut count)
        })?;
        for ordinal in 0..count {
            let mut device: c_int = 0;
            // SAFETY: `ordinal` is below the count the driver reported; out-pointer valid.
            check("cuDeviceGet", unsafe {
                cu_device_get(&mut device, ordinal)
            })?;
            let mut name_buf: [c_char; 256] = [0; 256];
            // SAFETY: the buffer holds `len` bytes and the driver NUL-terminates within them.
            check("cuDeviceGetName", unsafe {
                cu_device_get_name(name_buf.as_mut_ptr(), name_buf.len() as c_int, device)
            })?;
            // SAFETY: the buffer is NUL-terminated (zero-filled, and the driver writes at most
            // `len` bytes including the terminator).
            let gpu_name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            let mut total: usize = 0;
            // SAFETY: valid device handle and out-pointer.
            check("cuDeviceTotalMem_v2", unsafe {
                cu_device_total_mem(&mut total, device)
            })?;
            gpus.push(GpuInfo {
                ordinal,
                name: gpu_name,
                total_memory_bytes: total as u64,
            });
        }
    }
    Ok(CudaProbe {
        library: name.to_owned(),
        driver_version,
        gpus,
    })
}

/// Every driver symbol that the CUDA device (`cuda/driver.rs`) reaches through cudarc, by the
/// name cudarc loads.
const CUDARC_SYMBOLS: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxGetDevice",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuMemsetD32Async",
];

/// Whether cudarc's driver calls are safe to make: `Ok` when the library cudarc would load opens
/// and has every symbol of [`CUDARC_SYMBOLS`], else why not. Checked once per process.
pub(crate) fn cudarc_driver_ready() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(check_cudarc_library).clone()
}

/// Whether the CUDA library `name` (`nvrtc`, `cublas`, `cublasLt`) loads under one of the names
/// cudarc's loader tries: checked before cudarc touches it, since cudarc panics otherwise.
pub(crate) fn cudarc_library_ready(name: &str) -> Result<(), String> {
    let candidates = cudarc::get_lib_name_candidates(name);
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions; the
    // handle is dropped at once.
    let found = candidates
        .iter()
        .any(|candidate| unsafe { libloading::Library::new(candidate) }.is_ok());
    if found {
        Ok(())
    } else {
        Err(format!(
            "no {name} library found (tried {}); install the cuda toolkit or add its lib directory to LD_LIBRARY_PATH",
            candidates.join(", ")
        ))
    }
}

/// Whether the CUDA library `name`, as cudarc's loader finds it, has every one of `symbols`:
/// cudarc panics on a missing one, and some arrive only in later versions (`ncclCommSuspend`
/// in NCCL 2.29.7).
pub(crate) fn cudarc_library_has(name: &str, symbols: &[&str]) -> bool {
    // The first candidate that loads is the one cudarc opens.
    let library = cudarc::get_lib_name_candidates(name)
        .iter()
        // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions;
        // the handle is dropped at the end of this function.
        .find_map(|candidate| unsafe { libloading::Library::new(candidate) }.ok());
    library.is_some_and(|library| {
        symbols
            .iter()
            // SAFETY: only the symbol's presence is read; it is never called through this type.
            .all(|symbol| unsafe { library.get::<*const ()>(symbol.as_bytes()) }.is_ok())
    })
}

fn check_cudarc_library() -> Result<(), String> {
    // The same names, in the same order, as cudarc's own loader tries, so the library checked
    // here is the one cudarc opens.
    let candidates = cudarc::get_lib_name_candidates("cuda");
    for candidate in &candidates {
        // SAFETY: loading the CUDA driver library runs its initialisers, which have no
        // preconditions; the handle is dropped at the end of this block.
        let Ok(library) = (unsafe { libloading::Library::new(candidate) }) else {
            continue;
        };
        let missing: Vec<&str> = CUDARC_SYMBOLS
            .iter()
            .copied()
            // SAFETY: only the symbol's presence is read; it is never called through this type.
            .filter(|name| unsafe { library.get::<*const ()>(name.as_bytes()) }.is_err())
            .collect();
        return if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{candidate} lacks {}; update the nvidia driver",
                missing.join(", ")
            ))
        };
    }
    Err(format!(
        "no cuda driver library found (tried {})",
        candidates.join(", ")
    ))
}

/// NCCL as the probe found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NcclProbe {
    /// The library that loaded (`libnccl.so.2`, say).
    pub library: String,
    /// `ncclGetVersion`'s code (22703 for 2.27.3).
    pub version_code: i32,
}

impl NcclProbe {
    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let code = self.version_code;
        // Codes from NCCL 2.9 on are major*10000 + minor*100 + patch; older ones major*1000 + ...
        if code >= 10000 {
            format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
        } else {
            format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
        }
    }
}

type NcclGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

/// Loads NCCL and asks its version.
///
/// # Errors
/// [`DeviceError::CudaUnavailable`] when no NCCL library loads or lacks `ncclGetVersion`;
/// [`DeviceError::Cuda`] when `ncclGetVersion` fails.
pub fn probe_nccl() -> Result<NcclProbe, DeviceError> {
    let (library, name) = open_first(&NCCL_LIBRARIES).map_err(DeviceError::CudaUnavailable)?;
    let nccl_get_version: NcclGetVersion = symbol(&library, name, "ncclGetVersion")?;
    let mut version_code: c_int = 0;
    // SAFETY: the out-pointer is valid; ncclGetVersion needs no initialisation.
    let code = unsafe { nccl_get_version(&mut version_code) };
    if code != 0 {
        return Err(DeviceError::Cuda {
            call: "ncclGetVersion",
            message: format!("nccl result {code}"),
        });
    }
    Ok(NcclProbe {
        library: name.to_owned(),
        version_code,
    })
}

/// Opens the first library of `names` that loads. The library stays mapped after the handle drops
/// (`RTLD_NODELETE`): the CUDA driver starts threads that must not lose their code.
fn open_first(names: &[&'static str]) -> Result<(Library, &'static str), String> {
    let mut failures = Vec::new();
    for &name in names {
        // SAFETY: loading runs the library's initialisers; the CUDA driver and NCCL are system
        // libraries whose initialisers are safe to run in any process.
        match unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL | libc::RTLD_NODELETE) } {
            Ok(library) => return Ok((library, name)),
            Err(error) => failures.push(with_cause(&error)),
        }
    }
    Err(failures.join("; "))
}

/// The function `symbol` of `library`, copied out of its `Symbol` (the library never unloads).
fn symbol<T: Copy>(library: &Library, name: &str, symbol: &str) -> Result<T, DeviceError> {
    // SAFETY: every caller names `T` as the C signature the CUDA or NCCL headers declare for
    // `symbol`.
    let found = unsafe { library.get::<T>(symbol.as_bytes()) };
    found.map(|s| *s).map_err(|error| {
        DeviceError::CudaUnavailable(format!("{name} lacks {symbol}: {}", with_cause(&error)))
    })
}

/// The loader's own words (`dlerror`, which names the file) when libloading kept them.
fn with_cause(error: &libloading::Error) -> String {
    match std::error::Error::source(error) {
        Some(cause) => cause.to_string(),
        None => error.to_string(),
    }
}

/// Type, free and total space of the filesystem under a directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FsStats {
    /// The filesystem's magic number (`f_type` of `statfs(2)`).
    pub magic: i64,
    /// A name for the magic number (`ext4`, `xfs`, `tmpfs`, ...; `unknown` otherwise).
    pub kind: &'static str,
    /// Bytes an unprivileged writer can still use.
    pub free_bytes: u64,
    /// Size of the filesystem in bytes.
    pub total_bytes: u64,
}

impl FsStats {
    /// Whether the filesystem is tmpfs: RAM, not disk.
    pub fn is_tmpfs(&self) -> bool {
        self.magic == TMPFS_MAGIC
    }
}

/// `statfs(2)` of `path`.
///
/// # Errors
/// [`DeviceError::Os`] when the path does not exist or cannot be examined.
pub fn filesystem(path: &Path) -> Result<FsStats, DeviceError> {
    use std::os::unix::ffi::OsStrExt;
    let c_path =
        std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| DeviceError::Os {
            call: "statfs",
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("path {} contains a NUL byte", path.display()),
            ),
        })?;
    let mut stats = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c_path` is NUL-terminated and `stats` is valid, writable storage for one statfs.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), stats.as_mut_ptr()) };
    if rc != 0 {
        return Err(DeviceError::Os {
            call: "statfs",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: statfs returned 0, so it filled the whole struct (which started zeroed anyway).
    let stats = unsafe { stats.assume_init() };
    let block = stats.f_bsize as u64;
    let magic = stats.f_type;
    Ok(FsStats {
        magic,
        kind: filesystem_name(magic),
        free_bytes: stats.f_bavail * block,
        total_bytes: stats.f_blocks * block,
    })
}

/// A name for a `statfs` magic number.
fn filesystem_name(magic: i64) -> &'static str {
    match magic {
        TMPFS_MAGIC => "tmpfs",
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0x0102_1997 => "9p",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        0x5346_544E => "ntfs",
        0x4d44 => "vfat",
        0xFF53_4D42 => "cifs",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_lines_parse_to_kib() {
        let text = "MemTotal:       16314788 kB\nMemFree:  1000 kB\nMemAvailable:   9000123 kB\n";
        assert_eq!(meminfo_kib(text, "MemTotal"), Some(16_314_788));
        assert_eq!(meminfo_kib(text, "MemAvailable"), Some(9_000_123));
        assert_eq!(meminfo_kib(text, "Mem"), None);
        assert_eq!(meminfo_kib(text, "SwapTotal"), None);
    }

    #[test]
    fn host_info_reports_cores_and_memory() {
        let host = host_info().unwrap();
        assert!(host.cpu_cores >= 1);
        assert!(host.memory_total_bytes >= host.memory_available_bytes);
        assert!(host.memory_available_bytes > 0);
    }

    #[test]
    fn filesystem_of_a_temporary_directory_has_space() {
        let dir = tempfile::tempdir().unwrap();
        let stats = filesystem(dir.path()).unwrap();
        assert!(stats.total_bytes >= stats.free_bytes);
        assert!(stats.total_bytes > 0);
        assert_eq!(stats.kind, filesystem_name(stats.magic));
    }

    #[test]
    fn dev_shm_is_recognised_as_tmpfs() {
        let shm = Path::new("/dev/shm");
        if let Ok(stats) = filesystem(shm) {
            assert!(
                stats.is_tmpfs(),
                "/dev/shm is {} ({:#x})",
                stats.kind,
                stats.magic
            );
        }
    }

    #[test]
    fn filesystem_of_a_missing_path_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent");
        assert!(matches!(
            filesystem(&missing),
            Err(DeviceError::Os { call: "statfs", .. })
        ));
    }

    #[test]
    fn probes_never_panic_and_agree_with_each_other() {
        let found = probe(Some(Path::new("/")));
        assert!(found.host.is_ok());
        if let Ok(cuda) = &found.cuda {
            assert!(cuda.driver_version > 0);
            for gpu in &cuda.gpus {
                assert!(!gpu.name.is_empty() && gpu.total_memory_bytes > 0);
            }
        }
        assert!(matches!(found.disk, Some((_, Ok(_)))));
    }

    #[test]
    fn version_strings_follow_the_library_encodings() {
        let nccl = NcclProbe {
            library: "libnccl.so.2".into(),
            version_code: 22703,
        };
        assert_eq!(nccl.version_string(), "2.27.3");
        let cuda = CudaProbe {
            library: "libcuda.so.1".into(),
            driver_version: 13000,
            gpus: Vec::new(),
        };
        assert_eq!(cuda.driver_version_string(), "13.0");
    }
}
