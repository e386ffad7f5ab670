//! Tests of the disk store: round trips, checksums, manifests, unsafe paths and faults.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::device::CpuDevice;

const MIB: usize = 1 << 20;

/// A CPU device with two seeded random runs of 2 MiB, one per backup of a test.
struct Bench {
    device: Arc<dyn Device>,
    runs: [AddressRange; 2],
    expected: Vec<Vec<u8>>,
    dir: tempfile::TempDir,
}

impl Bench {
    fn new() -> Bench {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(32 * MIB as u64));
        let arena = device.reserve(8 * MIB).unwrap();
        let runs = [
            arena.slice(0, 2 * MIB).unwrap(),
            arena.slice(4 * MIB, 2 * MIB).unwrap(),
        ];
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let mut expected = Vec::new();
        for run in runs {
            device.commit(run).unwrap();
            let bytes: Vec<u8> = (0..run.len).map(|_| rng.random()).collect();
            device.write(&bytes, run).unwrap();
            expected.push(bytes);
        }
        Bench {
            device,
            runs,
            expected,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn store(&self) -> DiskStore {
        let pool = Arc::new(HostPool::new(Arc::clone(&self.device)));
        DiskStore::new(self.dir.path(), 0, MIB, pool).unwrap()
    }

    fn save(&self, store: &DiskStore, tag: &MemoryTag, run: usize) -> DiskBackup {
        store
            .save(self.device.as_ref(), tag, &self.runs[run..=run])
            .unwrap()
    }

    /// Scrambles run `run` on the device, loads `backup` into it and checks every byte.
    fn load_and_check(&self, store: &DiskStore, backup: &DiskBackup, run: usize) {
        let range = self.runs[run];
        self.device.write(&vec![0xa5; range.len], range).unwrap();
        store.load(self.device.as_ref(), backup, &[range]).unwrap();
        let mut back = vec![0u8; range.len];
        self.device.read(range, &mut back).unwrap();
        assert!(
            back == self.expected[run],
            "run {run} differs after the load"
        );
    }

    fn rank_dir(&self) -> PathBuf {
        self.dir.path().join("offload/rank-0")
    }
}

#[test]
fn a_named_tag_spelling_a_built_in_name_keeps_its_own_backup() {
    let bench = Bench::new();
    let store = bench.store();
    let builtin = bench.save(&store, &MemoryTag::Params, 0);
    let named = bench.save(&store, &MemoryTag::Named("params".to_string()), 1);
    assert_ne!(builtin.dir(), named.dir());
    bench.load_and_check(&store, &builtin, 0);
    bench.load_and_check(&store, &named, 1);
}

#[test]
fn two_stores_of_one_process_on_one_rank_keep_their_backups_apart() {
    let bench = Bench::new();
    let (actor, critic) = (bench.store(), bench.store());
    let first = bench.save(&actor, &MemoryTag::Params, 0);
    let second = bench.save(&critic, &MemoryTag::Params, 1);
    assert_eq!(first.dir(), bench.rank_dir().join("params"));
    assert_eq!(second.dir(), bench.rank_dir().join("params.1"));
    bench.load_and_check(&actor, &first, 0);
    bench.load_and_check(&critic, &second, 1);
}

#[test]
fn files_written_are_0600_and_tag_directories_0700() {
    use std::os::unix::fs::MetadataExt;
    let bench = Bench::new();
    let store = bench.store();
    let backup = bench.save(&store, &MemoryTag::Weights, 0);
    let mode = |path: &Path| std::fs::metadata(path).unwrap().mode() & 0o777;
    assert_eq!(mode(backup.dir()), 0o700);
    assert_eq!(mode(&backup.dir().join(DATA_FILE)), 0o600);
    assert_eq!(mode(&backup.dir().join(MANIFEST_FILE)), 0o600);
}

#[test]
fn a_symlink_planted_while_the_job_runs_is_refused_and_its_target_untouched() {
    let bench = Bench::new();
    let store = bench.store();
    let victim_dir = tempfile::tempdir().unwrap();
    let victim = victim_dir.path().join("precious");
    std::fs::write(&victim, b"keep me").unwrap();
    let tag_link = bench.rank_dir().join("params");
    std::os::unix::fs::symlink(victim_dir.path(), &tag_link).unwrap();
    let error = store
        .save(bench.device.as_ref(), &MemoryTag::Params, &bench.runs[..1])
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::UnsafePath { path, .. } if *path == tag_link),
        "{error}"
    );
    let grads = bench.rank_dir().join("grads");
    std::fs::create_dir(&grads).unwrap();
    let file_link = grads.join(DATA_FILE);
    std::os::unix::fs::symlink(&victim, &file_link).unwrap();
    let error = store
        .save(bench.device.as_ref(), &MemoryTag::Grads, &bench.runs[..1])
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::UnsafePath { path, .. } if *path == file_link),
        "{error}"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    assert_eq!(std::fs::read_dir(victim_dir.path()).unwrap().count(), 1);
}

#[test]
fn a_manifest_larger_than_the_one_written_is_refused_before_it_is_read() {
    let bench = Bench::new();
    let store = bench.store();
    let backup = bench.save(&store, &MemoryTag::Optimizer, 0);
    let manifest = backup.dir().join(MANIFEST_FILE);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&manifest)
        .unwrap();
    file.set_len(8 << 30).unwrap();
    drop(file);
    let error = store
        .load(bench.device.as_ref(), &backup, &bench.runs[..1])
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::Manifest { path, reason } if *path == manifest && reason.contains("8589934592 bytes")),
        "{error}"
    );
    std::fs::remove_file(&manifest).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &manifest).unwrap();
    let error = store
        .load(bench.device.as_ref(), &backup, &bench.runs[..1])
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::UnsafePath { path, .. } if *path == manifest),
        "{error}"
    );
}

#[test]
fn a_backup_whose_load_failed_is_kept_and_removed_by_the_next_job() {
    let bench = Bench::new();
    let store = bench.store();
    let backup = bench.save(&store, &MemoryTag::Weights, 0);
    let data = backup.dir().join(DATA_FILE);
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[MIB + 5] ^= 1;
    std::fs::write(&data, &bytes).unwrap();
    let error = store
        .load(bench.device.as_ref(), &backup, &bench.runs[..1])
        .unwrap_err();
    assert!(
        matches!(error, StoreError::ChecksumMismatch { chunk: 1, .. }),
        "{error}"
    );
    let dir = backup.dir().to_path_buf();
    store.remove(backup).unwrap();
    drop(store);
    assert!(
        dir.join(DATA_FILE).exists(),
        "the files of a failed load are kept"
    );
    assert!(dir.join(MANIFEST_FILE).exists());
    let next = bench.store();
    assert!(!dir.exists(), "the next job removes them");
    // The failed load left unspecified bytes on the device.
    bench
        .device
        .write(&bench.expected[0], bench.runs[0])
        .unwrap();
    let again = bench.save(&next, &MemoryTag::Weights, 0);
    bench.load_and_check(&next, &again, 0);
}

#[test]
fn a_store_removes_the_backups_it_still_holds_when_it_drops() {
    let bench = Bench::new();
    let store = bench.store();
    let backup = bench.save(&store, &MemoryTag::Named("bucket-3".to_string()), 0);
    let dir = backup.dir().to_path_buf();
    drop(backup);
    assert!(dir.join(DATA_FILE).exists());
    drop(store);
    assert!(!dir.exists(), "a dropped store leaves no backup behind");
}

#[test]
fn a_stopped_write_leaves_no_directory_behind_once_the_store_drops() {
    let bench = Bench::new();
    let store = bench.store();
    let bytes = bench.expected[0].clone();
    let stop = AtomicBool::new(true);
    let tag = MemoryTag::Named("stopped".to_string());
    let saved = store.save_host(&tag, &bytes, &bench.runs[0..1], &stop);
    assert!(matches!(saved, Ok(None)), "{saved:?}");
    let dir = bench.rank_dir().join("named-stopped");
    assert!(
        dir.exists() && !dir.join(DATA_FILE).exists(),
        "a stopped write removes its data"
    );
    drop(store);
    assert!(!dir.exists(), "and its directory with the store");
}

#[test]
fn a_removal_a_kill_interrupted_does_not_stop_the_next_job_removing_its_backups() {
    let bench = Bench::new();
    // As a kill between moving a backup away and unlinking it leaves it.
    let trash = bench.rank_dir().join(".removing-0-params");
    std::fs::create_dir_all(&trash).unwrap();
    std::fs::write(trash.join(DATA_FILE), vec![9u8; 8192]).unwrap();
    std::fs::write(trash.join(MANIFEST_FILE), b"{}").unwrap();
    let next = bench.store();
    assert!(!trash.exists(), "the interrupted removal is cleaned");
    for _ in 0..2 {
        let backup = bench.save(&next, &MemoryTag::Params, 0);
        bench.load_and_check(&next, &backup, 0);
        next.remove(backup).unwrap();
    }
}

#[test]
fn a_chunk_write_asked_to_stop_ends_before_its_next_piece() {
    let bench = Bench::new();
    let path = bench.dir.path().join("data");
    let file = File::create(&path).unwrap();
    let target = Target {
        file: &file,
        path: &path,
        direct: false,
    };
    let len = 3 * WRITE_PIECE;
    let mut buffer = bench.device.alloc_host(len).unwrap();
    let stop = AtomicBool::new(false);
    write_chunk(target, 1, len, &mut buffer, len, &stop).unwrap();
    assert_eq!(file.metadata().unwrap().len(), 2 * len as u64);
    stop.store(true, Ordering::SeqCst);
    let error = write_chunk(target, 2, len, &mut buffer, len, &stop).unwrap_err();
    assert!(matches!(error, StoreError::Stopped), "{error}");
    assert_eq!(
        file.metadata().unwrap().len(),
        2 * len as u64,
        "nothing written once stopped"
    );
}
