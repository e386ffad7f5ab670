//! Tests of the disk write behind a pause (a host budget for disk offload), on the CPU device
//! (and on the GPU with `MILES_TEST_DEVICE=cuda`): bit-exact round trips whether the write has
//! ended or not at the resume, a failed write that loses nothing and fails the next step, a
//! tag over the budget written in line, and a job ending during the write.

use std::path::Path;
use std::sync::Barrier;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::device::open_test_device;
use crate::store::{RankDir, StoreError};

const MIB: usize = 1 << 20;

/// A manager on the test device writing to disk under `dir` in 1 MiB chunks, with a host
/// budget of `budget` bytes; `prepare` may inject faults before any region exists.
fn manager(dir: &Path, budget: u64, prepare: impl FnOnce(&mut MemoryManager)) -> MemoryManager {
    let device = open_test_device(64 * MIB as u64).unwrap().shared();
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: Some(DiskSettings {
            dir: dir.to_path_buf(),
            rank: 0,
            chunk_bytes: MIB,
            host_budget_bytes: budget,
        }),
    };
    let mut memory = MemoryManager::new(device, settings).unwrap();
    prepare(&mut memory);
    memory
}

/// The optimizer tag (disk policy) with 6 MiB + 3 bytes of seeded random contents.
fn filled(memory: &MemoryManager) -> (Buffer, Vec<u8>) {
    let tag = MemoryTag::Optimizer;
    memory
        .create_region(tag, BackupPolicy::Disk, 16 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&MemoryTag::Optimizer, 6 * MIB + 3).unwrap();
    let mut data = vec![0u8; buffer.len()];
    ChaCha8Rng::seed_from_u64(21).fill_bytes(&mut data);
    buffer.write(0, &data).unwrap();
    (buffer, data)
}

fn same(buffer: &Buffer, data: &[u8]) -> bool {
    let mut bytes = vec![0u8; buffer.len()];
    buffer.read(0, &mut bytes).unwrap();
    bytes == data
}

fn tag_dir(dir: &Path) -> std::path::PathBuf {
    dir.join("offload/rank-0/optimizer")
}

fn has(dir: &Path, file: &str) -> bool {
    tag_dir(dir).join(file).exists()
}

#[test]
fn a_pause_within_the_budget_writes_behind_and_resumes_bit_exact_whether_the_write_ended_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let memory = manager(dir.path(), 16 * MIB as u64, |_| {});
    let (buffer, data) = filled(&memory);
    let tag = [MemoryTag::Optimizer];
    for cycle in 0..4 {
        let report = memory.pause(&tag[0]).unwrap();
        assert!(
            report.bytes >= data.len() as u64,
            "cycle {cycle}: {report:?}"
        );
        assert_eq!(memory.state(&tag[0]).unwrap(), RegionState::Paused);
        assert_eq!(
            memory.staged_bytes(),
            report.bytes,
            "cycle {cycle}: the pause took the host copy's path"
        );
        if cycle % 2 == 0 {
            memory.finish_writes(&tag).unwrap();
            assert!(
                has(dir.path(), "manifest.json"),
                "cycle {cycle}: the write ends with a manifest on disk"
            );
        }
        // Odd cycles resume at once: the write stops (or has ended) and the host copy serves.
        memory.resume(&tag[0]).unwrap();
        assert!(same(&buffer, &data), "cycle {cycle}: bytes differ");
        assert_eq!(
            memory.staged_bytes(),
            0,
            "cycle {cycle}: the budget comes back"
        );
        assert!(
            !has(dir.path(), "manifest.json") && !has(dir.path(), "data.bin"),
            "cycle {cycle}: the resume removed the disk copy"
        );
    }
}

#[test]
fn a_failed_background_write_loses_nothing_and_fails_the_next_step() {
    let dir = tempfile::tempdir().unwrap();
    let memory = manager(dir.path(), 16 * MIB as u64, |m| {
        m.inject_disk_write_fault(1)
    });
    let (buffer, data) = filled(&memory);
    let tag = [MemoryTag::Optimizer];
    memory.pause(&tag[0]).unwrap();
    let error = memory.finish_writes(&tag).unwrap_err();
    assert!(
        matches!(&error, MemoryError::BackgroundWrite { source, .. } if matches!(source.as_ref(), StoreError::Io { action, .. } if action.contains("chunk 1"))),
        "{error}"
    );
    assert!(error.to_string().contains("kept in host memory"), "{error}");
    assert_eq!(memory.state(&tag[0]).unwrap(), RegionState::Paused);
    assert!(
        !has(dir.path(), "data.bin"),
        "the failed write removed its files"
    );
    assert!(memory.staged_bytes() > 0, "the host copy is kept");
    memory.finish_writes(&tag).unwrap();
    memory.resume(&tag[0]).unwrap();
    assert!(
        same(&buffer, &data),
        "the host copy brought every byte back"
    );
    assert_eq!(memory.staged_bytes(), 0);

    // Without waiting: the resume either reports the failure (the write had ended) and a second
    // resume brings the bytes back, or it stops the write and brings them back at once.
    memory.pause(&tag[0]).unwrap();
    match memory.resume(&tag[0]) {
        Ok(_) => {}
        Err(MemoryError::BackgroundWrite { .. }) => {
            assert_eq!(memory.state(&tag[0]).unwrap(), RegionState::Paused);
            memory.resume(&tag[0]).unwrap();
        }
        Err(error) => panic!("{error}"),
    }
    assert!(same(&buffer, &data));
}

#[test]
fn a_tag_over_the_budget_goes_to_disk_in_line() {
    let dir = tempfile::tempdir().unwrap();
    let memory = manager(dir.path(), 4 * MIB as u64, |_| {});
    let (buffer, data) = filled(&memory);
    memory.pause(&MemoryTag::Optimizer).unwrap();
    assert_eq!(memory.staged_bytes(), 0, "no host copy");
    assert!(
        has(dir.path(), "manifest.json"),
        "written before the pause returns"
    );
    memory.resume(&MemoryTag::Optimizer).unwrap();
    assert!(same(&buffer, &data));
}

#[test]
fn a_job_ending_during_the_write_behind_leaves_files_the_next_job_removes() {
    let dir = tempfile::tempdir().unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let hold = Arc::clone(&barrier);
    let memory = manager(dir.path(), 16 * MIB as u64, |m| {
        m.inject_disk_write_hold(3, hold);
    });
    let (buffer, data) = filled(&memory);
    memory.pause(&MemoryTag::Optimizer).unwrap();
    barrier.wait();
    // The device memory is released and the write is cut short here: what a crash now leaves.
    assert!(has(dir.path(), "data.bin") && !has(dir.path(), "manifest.json"));
    let next = tempfile::tempdir().unwrap();
    let rank = next.path().join("offload/rank-0");
    std::fs::create_dir_all(rank.join("optimizer")).unwrap();
    std::fs::copy(
        tag_dir(dir.path()).join("data.bin"),
        rank.join("optimizer/data.bin"),
    )
    .unwrap();
    std::fs::write(rank.join("lock"), b"999999\n").unwrap();
    let next_job = RankDir::open(next.path(), 0).unwrap();
    let left: Vec<_> = std::fs::read_dir(next_job.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        ["lock"],
        "the next job finds the cut write and removes it"
    );
    barrier.wait();
    memory.finish_writes(&[MemoryTag::Optimizer]).unwrap();
    memory.resume(&MemoryTag::Optimizer).unwrap();
    assert!(same(&buffer, &data));
}
