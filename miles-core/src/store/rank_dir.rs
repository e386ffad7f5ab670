//! A rank's offload directory, `<dir>/offload/rank-<N>`: the one layout of every backend.
//!
//! Every file under it is opened relative to a directory handle the store opened itself, with
//! `O_NOFOLLOW`, so a symbolic link planted anywhere under `offload/` is refused, never
//! followed. Directories are created `0700` and files `0600`; the offload directory given must
//! belong to the user and must not be writable by every user.
//!
//! A job holds an exclusive `flock` on `rank-<N>/lock` (which holds its pid) for as long as it
//! uses the directory, so two jobs never share backup files. Whatever the directory holds when a
//! job takes the lock was left by a job that ended without cleaning up (killed while paused or
//! while removing a backup, or kept after a failed resume): the job checks that it is only
//! what a store writes, then removes it and says so in the log.
//!
//! One process may open the same rank directory from several stores (the actor and the critic,
//! or a trainer's offload and its optimizer streaming): they share one handle and one lock, and
//! each store names its tag directories apart (see [`RankDir::store_suffix`]).

use std::ffi::CStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::StoreError;
use super::error::Unsafe;

/// The offload directory's subdirectory that holds the rank directories.
pub(super) const OFFLOAD_DIR: &str = "offload";

/// The lock file of a rank directory.
const LOCK_FILE: &str = "lock";

/// The files a store writes in a tag directory.
pub(super) const DATA_FILE: &str = "data.bin";
pub(super) const MANIFEST_FILE: &str = "manifest.json";
pub(super) const MANIFEST_TMP: &str = "manifest.json.tmp";

/// Tag directories being removed start with this.
pub(super) const TRASH_PREFIX: &str = ".removing-";

/// The largest manifest read back when the size of the region it describes is not known (the
/// leftovers of an earlier job): 64 MiB holds the checksums of 5 TiB in 1 MiB chunks.
pub(super) const MANIFEST_MAX_BYTES: u64 = 64 << 20;

/// A directory's device and inode numbers.
type DirId = (u64, u64);

/// The rank directories this process holds, so that the stores of one rank share one lock.
static HELD: Mutex<Vec<(DirId, Weak<RankDir>)>> = Mutex::new(Vec::new());

/// A rank's offload directory, opened, checked and locked for this process.
#[derive(Debug)]
pub struct RankDir {
    path: PathBuf,
    dir: OwnedFd,
    /// Holds the `flock` for as long as the directory is open.
    _lock: OwnedFd,
    /// Stores opened on this directory so far.
    stores: AtomicUsize,
    /// Backups removed so far (names their trash directories).
    removed: AtomicUsize,
}

impl RankDir {
    /// Opens `<base>/offload/rank-<rank>`, creating what is missing (`base` as the user's umask
    /// says, the rest `0700`), locks it and removes what an earlier job left in it; a second
    /// call in the same process for the same directory returns the same handle.
    ///
    /// # Errors
    /// [`StoreError::UnsafePath`] for a `base` of another user or writable by every user, for a
    /// symbolic link or anything but a directory of this user at `offload` or `rank-<rank>`,
    /// or for leftovers that are not what a store writes (nothing is removed then);
    /// [`StoreError::Locked`] naming the pid of the job that holds the directory;
    /// [`StoreError::Io`] when a directory cannot be created, opened or cleaned.
    pub fn open(base: &Path, rank: usize) -> Result<Arc<RankDir>, StoreError> {
        std::fs::create_dir_all(base).map_err(io_error("create", base))?;
        let base_fd = rustix::fs::open(base, dir_flags(), Mode::empty())
            .map_err(errno_error("open", base))?;
        check_base(&base_fd, base)?;
        let offload_path = base.join(OFFLOAD_DIR);
        let offload = private_dir(&base_fd, &offload_path, OFFLOAD_DIR)?;
        let name = format!("rank-{rank}");
        let path = offload_path.join(&name);
        let dir = private_dir(&offload, &path, &name)?;
        let stat = rustix::fs::fstat(&dir).map_err(errno_error("stat", &path))?;
        let key = (stat.st_dev, stat.st_ino);
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|(_, open)| open.strong_count() > 0);
        if let Some(open) = held
            .iter()
            .find(|(held_key, _)| *held_key == key)
            .and_then(|(_, open)| open.upgrade())
        {
            return Ok(open);
        }
        let lock = take_lock(&dir, &path)?;
        let rank_dir = RankDir {
            path,
            dir,
            _lock: lock,
            stores: AtomicUsize::new(0),
            removed: AtomicUsize::new(0),
        };
        rank_dir.remove_leftovers()?;
        let rank_dir = Arc::new(rank_dir);
        held.push((key, Arc::downgrade(&rank_dir)));
        Ok(rank_dir)
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What a new store of this directory appends to its tag directories' names: nothing for
    /// the first store of the process, `.<k>` for the k-th after it (tag names hold no `.`, so
    /// no two stores share a tag directory).
    pub(super) fn store_suffix(&self) -> String {
        match self.stores.fetch_add(1, Ordering::Relaxed) {
            0 => String::new(),
            k => format!(".{k}"),
        }
    }

    /// Opens tag directory `name`, creating it `0700` when missing.
    ///
    /// # Errors
    /// [`StoreError::UnsafePath`] for a symbolic link or anything but a directory of this user;
    /// [`StoreError::Io`].
    pub(super) fn tag_dir(&self, name: &str) -> Result<OwnedFd, StoreError> {
        private_dir(&self.dir, &self.path.join(name), name)
    }

    /// Opens tag directory `name`, which must be there.
    ///
    /// # Errors
    /// [`StoreError::UnsafePath`] for a symbolic link or anything but a directory;
    /// [`StoreError::Io`] when it is missing.
    pub(super) fn existing_tag_dir(&self, name: &str) -> Result<OwnedFd, StoreError> {
        open_dir_at(&self.dir, &self.path.join(name), name)
    }

    /// Moves tag directory `name` out of the way; returns the name it has now.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the directory.
    pub(super) fn move_away(&self, name: &str) -> Result<String, StoreError> {
        let serial = self.removed.fetch_add(1, Ordering::Relaxed);
        let trash = format!("{TRASH_PREFIX}{serial}-{name}");
        rustix::fs::renameat(&self.dir, name, &self.dir, trash.as_str())
            .map_err(errno_error("move away", &self.path.join(name)))?;
        Ok(trash)
    }

    /// Removes the files of tag directory `name` (never following a link), then the directory.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming what could not be removed (a directory inside it, say).
    pub(super) fn remove_tag_dir(&self, name: &str) -> Result<(), StoreError> {
        let path = self.path.join(name);
        let dir = open_dir_at(&self.dir, &path, name)?;
        for entry_name in entries(&dir, &path)? {
            rustix::fs::unlinkat(&dir, entry_name.as_str(), AtFlags::empty())
                .map_err(errno_error("remove", &path.join(&entry_name)))?;
        }
        rustix::fs::unlinkat(&self.dir, name, AtFlags::REMOVEDIR)
            .map_err(errno_error("remove", &path))
    }

    /// Checks that every entry but the lock is a tag directory holding only files a store
    /// writes, then removes them all, logging what each was.
    fn remove_leftovers(&self) -> Result<(), StoreError> {
        let mut found = Vec::new();
        for name in entries(&self.dir, &self.path)? {
            if name != LOCK_FILE {
                let what = self.inspect(&name)?;
                found.push((name, what));
            }
        }
        for (name, what) in found {
            self.remove_tag_dir(&name)?;
            tracing::warn!(
                dir = %self.path.join(&name).display(),
                "removed {what} that an earlier job on this offload directory left"
            );
        }
        Ok(())
    }

    /// What leftover `name` is, once it is known to hold only files a store writes.
    fn inspect(&self, name: &str) -> Result<String, StoreError> {
        let path = self.path.join(name);
        let dir = open_dir_at(&self.dir, &path, name)?;
        check_owner(&dir, &path)?;
        let mut has_manifest = false;
        for entry in entries(&dir, &path)? {
            let entry_path = path.join(&entry);
            let stat = rustix::fs::statat(&dir, entry.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(errno_error("stat", &entry_path))?;
            let kind = FileType::from_raw_mode(stat.st_mode);
            if kind.is_symlink() {
                return Err(refused(entry_path, Unsafe::Symlink));
            }
            if !kind.is_file()
                || ![DATA_FILE, MANIFEST_FILE, MANIFEST_TMP].contains(&entry.as_str())
            {
                return Err(unknown_entry(entry_path));
            }
            has_manifest |= entry == MANIFEST_FILE;
        }
        if name.starts_with(TRASH_PREFIX) {
            return Ok("a backup whose removal was interrupted".to_string());
        }
        if !has_manifest {
            return Ok("an incomplete backup".to_string());
        }
        let described = read_bounded(&dir, &path.join(MANIFEST_FILE), MANIFEST_MAX_BYTES)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
            .and_then(|manifest| {
                let tag = manifest.get("tag")?.as_str()?.to_string();
                let bytes = manifest.get("total_bytes")?.as_u64()?;
                Some(format!("the backup of tag {tag} ({bytes} bytes)"))
            });
        Ok(described.unwrap_or_else(|| "a backup with an unreadable manifest".to_string()))
    }
}

/// Flags of a directory handle.
fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC
}

/// The offload directory given must belong to this user and must not be writable by every
/// user (another user could plant links in it).
fn check_base(fd: &OwnedFd, path: &Path) -> Result<(), StoreError> {
    check_owner(fd, path)?;
    let stat = rustix::fs::fstat(fd).map_err(errno_error("stat", path))?;
    if stat.st_mode & 0o002 != 0 {
        return Err(refused(path.to_path_buf(), Unsafe::WorldWritable));
    }
    Ok(())
}

/// The directory behind `fd` must belong to this user.
fn check_owner(fd: &OwnedFd, path: &Path) -> Result<(), StoreError> {
    let stat = rustix::fs::fstat(fd).map_err(errno_error("stat", path))?;
    let me = rustix::process::geteuid().as_raw();
    if stat.st_uid != me {
        return Err(refused(
            path.to_path_buf(),
            Unsafe::OtherOwner {
                owner: stat.st_uid,
                me,
            },
        ));
    }
    Ok(())
}

/// Opens directory `name` of `parent` (at `path`), creating it `0700` when missing; it must be
/// a directory of this user, and is made `0700` when it is not.
fn private_dir(parent: &OwnedFd, path: &Path, name: &str) -> Result<OwnedFd, StoreError> {
    match rustix::fs::mkdirat(parent, name, Mode::RWXU) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(errno) => return Err(errno_error("create", path)(errno)),
    }
    let dir = open_dir_at(parent, path, name)?;
    check_owner(&dir, path)?;
    let stat = rustix::fs::fstat(&dir).map_err(errno_error("stat", path))?;
    if stat.st_mode & 0o077 != 0 {
        rustix::fs::fchmod(&dir, Mode::RWXU).map_err(errno_error("chmod 0700", path))?;
    }
    Ok(dir)
}

/// Opens directory `name` of `parent` (at `path`) without following a link.
fn open_dir_at(parent: &OwnedFd, path: &Path, name: &str) -> Result<OwnedFd, StoreError> {
    rustix::fs::openat(parent, name, dir_flags() | OFlags::NOFOLLOW, Mode::empty()).map_err(
        |errno| match errno {
            Errno::LOOP | Errno::NOTDIR => not_a_directory(parent, path, name),
            errno => errno_error("open", path)(errno),
        },
    )
}

/// The error for `name` of `parent` that is not a directory: a link or something else.
fn not_a_directory(parent: &OwnedFd, path: &Path, name: &str) -> StoreError {
    let link = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|stat| FileType::from_raw_mode(stat.st_mode).is_symlink());
    let reason = if link {
        Unsafe::Symlink
    } else {
        Unsafe::NotADirectory
    };
    refused(path.to_path_buf(), reason)
}

/// The error for an entry of the offload directory that a store does not write.
fn unknown_entry(path: PathBuf) -> StoreError {
    refused(path, Unsafe::Foreign)
}

/// [`StoreError::UnsafePath`] for something in the offload directory that should not be there.
pub(super) fn refused(path: PathBuf, reason: Unsafe) -> StoreError {
    StoreError::UnsafePath { path, reason }
}

/// The names in directory `dir` (at `path`), without `.` and `..`.
///
/// # Errors
/// [`StoreError::UnsafePath`] for a name that is not UTF-8 (a store never writes one).
fn entries(dir: &OwnedFd, path: &Path) -> Result<Vec<String>, StoreError> {
    let listing = rustix::fs::Dir::read_from(dir).map_err(errno_error("list", path))?;
    let mut names = Vec::new();
    for entry in listing {
        let entry = entry.map_err(errno_error("list", path))?;
        let name: &CStr = entry.file_name();
        let bytes = name.to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        match name.to_str() {
            Ok(name) => names.push(name.to_string()),
            Err(_) => {
                return Err(unknown_entry(
                    path.join(String::from_utf8_lossy(bytes).as_ref()),
                ));
            }
        }
    }
    Ok(names)
}

/// Takes the exclusive lock of rank directory `dir` (at `path`) and writes this process's pid
/// into the lock file.
fn take_lock(dir: &OwnedFd, path: &Path) -> Result<OwnedFd, StoreError> {
    let lock_path = path.join(LOCK_FILE);
    let fd = rustix::fs::openat(
        dir,
        LOCK_FILE,
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|errno| match errno {
        Errno::LOOP => refused(lock_path.clone(), Unsafe::Symlink),
        errno => errno_error("open", &lock_path)(errno),
    })?;
    let stat = rustix::fs::fstat(&fd).map_err(errno_error("stat", &lock_path))?;
    if !FileType::from_raw_mode(stat.st_mode).is_file() {
        return Err(unknown_entry(lock_path));
    }
    match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(Errno::WOULDBLOCK) => {
            let pid = read_bounded(&fd, &lock_path, 32)
                .ok()
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .and_then(|text| text.trim().parse().ok());
            return Err(StoreError::Locked {
                dir: path.to_path_buf(),
                pid,
            });
        }
        Err(errno) => return Err(errno_error("lock", &lock_path)(errno)),
    }
    rustix::fs::ftruncate(&fd, 0).map_err(errno_error("truncate", &lock_path))?;
    let file = File::from(fd);
    file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)
        .map_err(io_error("write", &lock_path))?;
    Ok(OwnedFd::from(file))
}

/// Reads the whole regular file behind `fd` (at `path`) when it holds at most `limit` bytes.
///
/// # Errors
/// [`StoreError::Manifest`] naming the file when it is not a regular file or is larger than
/// `limit`; [`StoreError::Io`].
pub(super) fn read_bounded(fd: &impl AsFd, path: &Path, limit: u64) -> Result<Vec<u8>, StoreError> {
    let stat = rustix::fs::fstat(fd).map_err(errno_error("stat", path))?;
    let refuse = |reason: String| StoreError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    if !FileType::from_raw_mode(stat.st_mode).is_file() {
        return Err(refuse("it is not a regular file".to_string()));
    }
    let size = u64::try_from(stat.st_size).unwrap_or(u64::MAX);
    if size > limit {
        return Err(refuse(format!(
            "it holds {size} bytes, more than the {limit} it can hold"
        )));
    }
    let file = File::from(
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(io_error("read", path))?,
    );
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io_error("read", path))?;
    if bytes.len() as u64 > limit {
        return Err(refuse(format!(
            "it grew past {limit} bytes while being read"
        )));
    }
    Ok(bytes)
}

/// An [`StoreError::Io`] for a failed `action` on `path`.
pub(super) fn io_error<'a>(
    action: &'a str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        action: action.to_string(),
        path: path.to_path_buf(),
        source,
    }
}

/// An [`StoreError::Io`] for a failed `action` on `path`, from the system's error number.
pub(super) fn errno_error<'a>(
    action: &'a str,
    path: &'a Path,
) -> impl FnOnce(Errno) -> StoreError + 'a {
    move |errno| io_error(action, path)(std::io::Error::from(errno))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    /// A directory of another user: the victim a planted link points at.
    fn victim() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("precious");
        std::fs::write(&file, b"keep me").unwrap();
        (dir, file)
    }

    fn assert_untouched(victim: &Path) {
        assert_eq!(
            std::fs::read(victim).unwrap(),
            b"keep me",
            "the link's target changed"
        );
        let entries = std::fs::read_dir(victim.parent().unwrap()).unwrap().count();
        assert_eq!(entries, 1, "something was written beside the link's target");
    }

    fn assert_refused(result: Result<Arc<RankDir>, StoreError>, path: &Path) {
        match result {
            Err(error @ StoreError::UnsafePath { .. }) => {
                assert!(error.is_bad_settings());
                let message = error.to_string();
                assert!(
                    message.contains(&path.display().to_string()),
                    "the message names {}: {message}",
                    path.display()
                );
            }
            other => panic!("expected a refusal naming {}: {other:?}", path.display()),
        }
    }

    #[test]
    fn a_symlink_at_the_offload_or_rank_directory_is_refused_and_its_target_untouched() {
        let (victim_dir, victim_file) = victim();
        let base = tempfile::tempdir().unwrap();
        let offload = base.path().join(OFFLOAD_DIR);
        std::os::unix::fs::symlink(victim_dir.path(), &offload).unwrap();
        assert_refused(RankDir::open(base.path(), 0), &offload);
        assert_untouched(&victim_file);
        std::fs::remove_file(&offload).unwrap();
        std::fs::create_dir(&offload).unwrap();
        let rank = offload.join("rank-0");
        std::os::unix::fs::symlink(victim_dir.path(), &rank).unwrap();
        assert_refused(RankDir::open(base.path(), 0), &rank);
        assert_untouched(&victim_file);
    }

    #[test]
    fn a_symlink_planted_in_a_tag_directory_before_the_job_is_refused_and_nothing_is_removed() {
        let (victim_dir, victim_file) = victim();
        let base = tempfile::tempdir().unwrap();
        let rank = base.path().join("offload/rank-0");
        std::fs::create_dir_all(rank.join("params")).unwrap();
        std::fs::write(rank.join("params").join(MANIFEST_FILE), b"{}").unwrap();
        let link = rank.join("params").join(DATA_FILE);
        std::os::unix::fs::symlink(&victim_file, &link).unwrap();
        assert_refused(RankDir::open(base.path(), 0), &link);
        assert_untouched(&victim_file);
        assert!(
            rank.join("params").join(MANIFEST_FILE).exists(),
            "nothing is removed"
        );
        std::fs::remove_dir_all(rank.join("params")).unwrap();
        let tag_link = rank.join("grads");
        std::os::unix::fs::symlink(victim_dir.path(), &tag_link).unwrap();
        assert_refused(RankDir::open(base.path(), 0), &tag_link);
        assert_untouched(&victim_file);
    }

    #[test]
    fn directories_are_made_0700_and_the_lock_file_0600() {
        let base = tempfile::tempdir().unwrap();
        let offload = base.path().join(OFFLOAD_DIR);
        std::fs::create_dir(&offload).unwrap();
        std::fs::set_permissions(&offload, std::fs::Permissions::from_mode(0o755)).unwrap();
        let rank_dir = RankDir::open(base.path(), 3).unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o777;
        assert_eq!(
            mode(&offload),
            0o700,
            "an existing offload directory is made private"
        );
        assert_eq!(mode(rank_dir.path()), 0o700);
        assert_eq!(mode(&rank_dir.path().join(LOCK_FILE)), 0o600);
        assert_eq!(rank_dir.path(), offload.join("rank-3"));
    }

    #[test]
    fn an_offload_directory_every_user_may_write_to_is_refused() {
        let base = tempfile::tempdir().unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_refused(RankDir::open(base.path(), 0), base.path());
        assert!(
            !base.path().join(OFFLOAD_DIR).exists(),
            "nothing is created in it"
        );
    }

    #[test]
    fn an_offload_directory_of_another_user_is_refused() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: giving a directory to another user needs root");
            return;
        }
        let nobody = rustix::process::Uid::from_raw(65534);
        let base = tempfile::tempdir().unwrap();
        rustix::fs::chown(base.path(), Some(nobody), None).unwrap();
        assert_refused(RankDir::open(base.path(), 0), base.path());
        rustix::fs::chown(base.path(), Some(rustix::process::geteuid()), None).unwrap();
        let offload = base.path().join(OFFLOAD_DIR);
        std::fs::create_dir(&offload).unwrap();
        rustix::fs::chown(&offload, Some(nobody), None).unwrap();
        assert_refused(RankDir::open(base.path(), 0), &offload);
    }

    #[test]
    fn a_second_job_on_a_rank_directory_is_refused_naming_the_first_jobs_pid() {
        let base = tempfile::tempdir().unwrap();
        let rank = base.path().join("offload/rank-0");
        std::fs::create_dir_all(&rank).unwrap();
        // The other job: its own open file description of the lock, locked, with its pid.
        let other = File::create(rank.join(LOCK_FILE)).unwrap();
        rustix::fs::flock(&other, FlockOperation::NonBlockingLockExclusive).unwrap();
        other.write_all_at(b"4242\n", 0).unwrap();
        let error = RankDir::open(base.path(), 0).unwrap_err();
        assert!(
            matches!(&error, StoreError::Locked { dir, pid: Some(4242) } if *dir == rank),
            "{error:?}"
        );
        assert!(error.is_bad_settings());
        let message = error.to_string();
        assert!(message.contains("pid 4242"), "{message}");
        assert!(message.contains(&rank.display().to_string()), "{message}");
        drop(other);
        let rank_dir = RankDir::open(base.path(), 0).unwrap();
        let pid = std::fs::read_to_string(rank_dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(pid.trim(), std::process::id().to_string());
        let again = RankDir::open(base.path(), 0).unwrap();
        assert!(
            Arc::ptr_eq(&rank_dir, &again),
            "one process shares one handle and lock"
        );
    }

    #[test]
    fn leftovers_of_a_killed_job_are_removed_when_the_next_job_takes_the_lock() {
        let base = tempfile::tempdir().unwrap();
        let rank = base.path().join("offload/rank-0");
        let removing = rank.join(format!("{TRASH_PREFIX}0-params"));
        let paused = rank.join("optimizer");
        let partial = rank.join("named-bench");
        for dir in [&removing, &paused, &partial] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(DATA_FILE), vec![7u8; 8192]).unwrap();
        }
        let manifest = r#"{"tag": "optimizer", "total_bytes": 8192}"#;
        std::fs::write(paused.join(MANIFEST_FILE), manifest).unwrap();
        std::fs::write(rank.join(LOCK_FILE), b"999999\n").unwrap();
        let rank_dir = RankDir::open(base.path(), 0).unwrap();
        let left: Vec<_> = std::fs::read_dir(rank_dir.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(left, [LOCK_FILE], "a stale lock's leftovers are removed");
    }

    #[test]
    fn a_leftover_the_store_did_not_write_is_refused_and_nothing_is_removed() {
        let base = tempfile::tempdir().unwrap();
        let rank = base.path().join("offload/rank-0");
        std::fs::create_dir_all(rank.join("params")).unwrap();
        std::fs::write(rank.join("params").join(DATA_FILE), b"x").unwrap();
        let stranger = rank.join("notes.txt");
        std::fs::write(&stranger, b"mine").unwrap();
        assert_refused(RankDir::open(base.path(), 0), &stranger);
        assert!(rank.join("params").join(DATA_FILE).exists());
    }
}
