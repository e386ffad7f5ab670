//! The per-thread region configuration torch_memory_saver's Python layer sets around each
//! `region()`, and the environment variables it reads.
//!
//! As in torch_memory_saver, the configuration belongs to the calling thread (PyTorch calls the
//! allocator on the thread that allocates) and each switch starts from its `TMS_INIT_*`
//! variable, read the first time the thread asks, so a process started under `LD_PRELOAD`
//! with `TMS_INIT_ENABLE=1` allocates everything into the default tag.

use std::cell::RefCell;

use miles_core::BackupPolicy;

use crate::TorchError;

/// The tag allocations go to before any `set_current_tag`.
pub const DEFAULT_TAG: &str = "default";

/// The one CPU backup backend: a pinned pool.
pub const PINNED_BACKEND: &str = "pinned";

/// The switches of one thread.
#[derive(Clone, Debug, Default)]
struct ThreadConfig {
    tag: Option<String>,
    interesting: Option<bool>,
    cpu_backup: Option<bool>,
    backend: Option<String>,
    disk_backup: Option<bool>,
}

thread_local! {
    static CONFIG: RefCell<ThreadConfig> = RefCell::new(ThreadConfig::default());
}

/// What an allocation on this thread is, by the thread's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionConfig {
    /// The torch_memory_saver tag.
    pub tag: String,
    /// Where the bytes go while the tag is paused.
    pub policy: BackupPolicy,
}

/// A boolean environment variable: unset or empty is `default`; `1`/`true`/`yes` and
/// `0`/`false`/`no` in any case.
///
/// # Errors
/// [`TorchError::BadEnv`] for any other value.
pub fn env_bool(var: &'static str, default: bool) -> Result<bool, TorchError> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(value) => parse_bool(&value).ok_or(TorchError::BadEnv {
            var,
            value,
            expected: "a boolean: 1/0, true/false or yes/no",
        }),
    }
}

fn parse_bool(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A switch of the thread: its set value, else its `TMS_INIT_*` variable (kept once read).
fn switch(
    pick: impl Fn(&mut ThreadConfig) -> &mut Option<bool>,
    var: &'static str,
) -> Result<bool, TorchError> {
    CONFIG.with(|config| {
        let mut config = config.borrow_mut();
        let slot = pick(&mut config);
        if let Some(value) = *slot {
            return Ok(value);
        }
        let value = env_bool(var, false)?;
        *slot = Some(value);
        Ok(value)
    })
}

fn set_switch(pick: impl Fn(&mut ThreadConfig) -> &mut Option<bool>, value: bool) {
    CONFIG.with(|config| *pick(&mut config.borrow_mut()) = Some(value));
}

/// Whether allocations on this thread go to a tag (`TMS_INIT_ENABLE` until set).
///
/// # Errors
/// [`TorchError::BadEnv`].
pub fn interesting_region() -> Result<bool, TorchError> {
    switch(|c| &mut c.interesting, "TMS_INIT_ENABLE")
}

/// See [`interesting_region`].
pub fn set_interesting_region(value: bool) {
    set_switch(|c| &mut c.interesting, value);
}

/// Whether new allocations on this thread get a CPU backup (`TMS_INIT_ENABLE_CPU_BACKUP`).
///
/// # Errors
/// [`TorchError::BadEnv`].
pub fn cpu_backup() -> Result<bool, TorchError> {
    switch(|c| &mut c.cpu_backup, "TMS_INIT_ENABLE_CPU_BACKUP")
}

/// See [`cpu_backup`].
pub fn set_cpu_backup(value: bool) {
    set_switch(|c| &mut c.cpu_backup, value);
}

/// Whether new allocations on this thread get a disk backup (`TMS_INIT_ENABLE_DISK_BACKUP`).
///
/// # Errors
/// [`TorchError::BadEnv`].
pub fn disk_backup() -> Result<bool, TorchError> {
    switch(|c| &mut c.disk_backup, "TMS_INIT_ENABLE_DISK_BACKUP")
}

/// See [`disk_backup`].
pub fn set_disk_backup(value: bool) {
    set_switch(|c| &mut c.disk_backup, value);
}

/// The tag of this thread's allocations.
pub fn tag() -> String {
    CONFIG.with(|config| {
        config
            .borrow()
            .tag
            .clone()
            .unwrap_or_else(|| DEFAULT_TAG.to_string())
    })
}

/// Set the tag of this thread's allocations.
///
/// # Errors
/// [`TorchError::NoTag`] for a NULL or empty tag (torch_memory_saver's "every tag" when
/// pausing, so no allocation can have it).
pub fn set_tag(tag: Option<&str>) -> Result<(), TorchError> {
    match tag {
        Some(tag) if !tag.is_empty() => {
            CONFIG.with(|config| config.borrow_mut().tag = Some(tag.to_string()));
            Ok(())
        }
        _ => Err(TorchError::NoTag),
    }
}

/// The CPU backup backend of this thread (`TMS_INIT_CPU_BACKUP_BACKEND`, default `pinned`).
pub fn backend() -> String {
    CONFIG.with(|config| {
        let mut config = config.borrow_mut();
        config
            .backend
            .get_or_insert_with(|| match std::env::var("TMS_INIT_CPU_BACKUP_BACKEND") {
                Ok(value) if !value.is_empty() => value,
                _ => PINNED_BACKEND.to_string(),
            })
            .clone()
    })
}

/// Set the CPU backup backend of this thread; `None` keeps it.
///
/// # Errors
/// [`TorchError::Backend`] for anything but `pinned`.
pub fn set_backend(backend: Option<&str>) -> Result<(), TorchError> {
    let Some(backend) = backend else {
        return Ok(());
    };
    check_backend(backend)?;
    CONFIG.with(|config| config.borrow_mut().backend = Some(backend.to_string()));
    Ok(())
}

fn check_backend(backend: &str) -> Result<(), TorchError> {
    if backend == PINNED_BACKEND {
        Ok(())
    } else {
        Err(TorchError::Backend {
            backend: backend.to_string(),
        })
    }
}

/// What an allocation on this thread is now: `None` outside a region.
///
/// # Errors
/// [`TorchError::BadEnv`]; [`TorchError::BothBackups`] when CPU and disk backup are both on;
/// [`TorchError::Backend`] for an unsupported backend.
pub fn current() -> Result<Option<RegionConfig>, TorchError> {
    if !interesting_region()? {
        return Ok(None);
    }
    let tag = tag();
    let policy = match (cpu_backup()?, disk_backup()?) {
        (true, true) => return Err(TorchError::BothBackups { tag }),
        (true, false) => {
            check_backend(&backend())?;
            BackupPolicy::Host
        }
        (false, true) => BackupPolicy::Disk,
        (false, false) => BackupPolicy::None,
    };
    Ok(Some(RegionConfig { tag, policy }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_starts_outside_regions_in_the_default_tag_and_keeps_its_own_switches() {
        assert_eq!(current().unwrap(), None);
        set_interesting_region(true);
        assert_eq!(
            current().unwrap(),
            Some(RegionConfig {
                tag: DEFAULT_TAG.to_string(),
                policy: BackupPolicy::None
            })
        );
        set_tag(Some("weights")).unwrap();
        set_cpu_backup(true);
        assert_eq!(current().unwrap().unwrap().policy, BackupPolicy::Host);
        set_disk_backup(true);
        assert!(matches!(current(), Err(TorchError::BothBackups { .. })));
        set_cpu_backup(false);
        assert_eq!(current().unwrap().unwrap().policy, BackupPolicy::Disk);
        let other = std::thread::spawn(|| (tag(), interesting_region().unwrap()))
            .join()
            .unwrap();
        assert_eq!(other, (DEFAULT_TAG.to_string(), false));
        assert!(matches!(set_tag(Some("")), Err(TorchError::NoTag)));
        assert!(matches!(set_tag(None), Err(TorchError::NoTag)));
        assert_eq!(tag(), "weights");
    }

    #[test]
    fn only_the_pinned_backend_is_accepted() {
        assert_eq!(backend(), PINNED_BACKEND);
        set_backend(Some("pinned")).unwrap();
        let error = set_backend(Some("mmap")).unwrap_err();
        assert!(error.to_string().contains("mmap"), "{error}");
        assert_eq!(backend(), PINNED_BACKEND);
    }

    #[test]
    fn booleans_read_as_torch_memory_saver_writes_them() {
        for (text, value) in [("1", true), ("TRUE", true), ("yes", true), ("0", false)] {
            assert_eq!(parse_bool(text), Some(value), "{text}");
        }
        assert_eq!(parse_bool(""), Some(false));
        assert_eq!(parse_bool("maybe"), None);
    }
}
