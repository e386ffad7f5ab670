//! Tests of a region's pause and resume on a fault-injecting device: releases part by part,
//! failures half way, and where a part lies in its backup.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::device::{FaultyDevice, open_test_device};
use crate::memory::{Buffer, ManagerSettings, MemoryManager};

use super::*;

const MIB: usize = 1 << 20;

/// A manager on a [`FaultyDevice`] over the test device (see [`open_test_device`]) of
/// `capacity` bytes that cuts releases into parts of `part_len` bytes (0: whole).
fn faulty(capacity: usize, part_len: usize) -> (Arc<FaultyDevice>, MemoryManager) {
    let device = Arc::new(FaultyDevice::over(
        open_test_device(capacity as u64).unwrap().shared(),
        part_len,
    ));
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = MemoryManager::new(Arc::clone(&device) as Arc<dyn Device>, settings).unwrap();
    (device, memory)
}

/// Buffers of several sizes in a host-backed tag, filled with seeded random bytes; their
/// blocks commit as more than one run.
fn filled(memory: &MemoryManager, tag: &MemoryTag, seed: u64) -> Vec<(Buffer, Vec<u8>)> {
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 64 * MIB)
        .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    [5 * MIB + 3, 1, 11 * MIB + 17, 300_001]
        .iter()
        .map(|&len| {
            let mut buffer = memory.alloc(tag, len).unwrap();
            let mut data = vec![0u8; len];
            rng.fill_bytes(&mut data);
            buffer.write(0, &data).unwrap();
            (buffer, data)
        })
        .collect()
}

fn first_difference_in(buffers: &[(Buffer, Vec<u8>)]) -> Option<(usize, usize)> {
    buffers
        .iter()
        .enumerate()
        .find_map(|(index, (buffer, data))| {
            let mut back = vec![0u8; buffer.len()];
            buffer.read(0, &mut back).unwrap();
            back.iter()
                .zip(data)
                .position(|(x, y)| x != y)
                .map(|at| (index, at))
        })
}

#[test]
fn a_resume_that_fails_half_way_releases_what_it_committed_and_stays_paused() {
    let (device, memory) = faulty(128 * MIB, 2 * MIB);
    let tag = MemoryTag::Named("half-way".to_string());
    let buffers = filled(&memory, &tag, 37);
    memory.pause(&tag).unwrap();
    let free_paused = device.memory_info().unwrap().free;
    device.fail_commit_in.store(3, Ordering::SeqCst);
    let error = memory.resume(&tag).unwrap_err();
    assert!(
        matches!(
            &error,
            MemoryError::Device {
                source: DeviceError::OutOfMemory { .. },
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
    assert_eq!(
        device.memory_info().unwrap().free,
        free_paused,
        "the parts committed before the failure are released again"
    );
    memory.resume(&tag).unwrap();
    let diff = first_difference_in(&buffers);
    assert_eq!(diff, None, "(buffer, byte) differing first after the retry");
}

#[test]
fn a_pause_releasing_part_by_part_resumes_every_byte_at_the_same_addresses() {
    let (_, memory) = faulty(128 * MIB, 4 * MIB);
    let tag = MemoryTag::Named("parts".to_string());
    let buffers = filled(&memory, &tag, 41);
    let addresses: Vec<u64> = buffers.iter().map(|(b, _)| b.address()).collect();
    for cycle in 0..3 {
        let paused = memory.pause(&tag).unwrap();
        assert_eq!(paused.bytes, memory.region_bytes(&tag).unwrap());
        assert_eq!(paused.free_after - paused.free_before, paused.bytes);
        let resumed = memory.resume(&tag).unwrap();
        assert_eq!(resumed.bytes, paused.bytes, "cycle {cycle}");
        let diff = first_difference_in(&buffers);
        assert_eq!(diff, None, "cycle {cycle}: (buffer, byte) differing first");
    }
    let now: Vec<u64> = buffers.iter().map(|(b, _)| b.address()).collect();
    assert_eq!(now, addresses);
}

#[test]
fn a_pause_failing_after_some_parts_stays_paused_and_resumes_them_bit_exact() {
    let (device, memory) = faulty(128 * MIB, 2 * MIB);
    let tag = MemoryTag::Named("part-fault".to_string());
    let buffers = filled(&memory, &tag, 43);
    let total = memory.region_bytes(&tag).unwrap();
    let free_active = device.memory_info().unwrap().free;
    device.fail_release_in.store(3, Ordering::SeqCst);
    let error = memory.pause(&tag).unwrap_err();
    assert!(
        matches!(
            &error,
            MemoryError::Device {
                source: DeviceError::Cuda { .. },
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
    let freed = device.memory_info().unwrap().free - free_active;
    assert_eq!(
        freed,
        4 * MIB as u64,
        "the two parts before the fault are free"
    );
    assert_eq!(memory.region_bytes(&tag).unwrap(), total);
    let resumed = memory.resume(&tag).unwrap();
    assert_eq!(resumed.bytes, 4 * MIB as u64);
    assert_eq!(device.memory_info().unwrap().free, free_active);
    assert_eq!(
        first_difference_in(&buffers),
        None,
        "after the partial pause"
    );
    memory.pause(&tag).unwrap();
    memory.resume(&tag).unwrap();
    assert_eq!(first_difference_in(&buffers), None, "after a whole cycle");
}

#[test]
fn a_pause_failing_at_its_first_release_leaves_the_tag_active_and_intact() {
    let (device, memory) = faulty(128 * MIB, 2 * MIB);
    let tag = MemoryTag::Named("first-fault".to_string());
    let buffers = filled(&memory, &tag, 47);
    let free_active = device.memory_info().unwrap().free;
    device.fail_release_in.store(1, Ordering::SeqCst);
    memory.pause(&tag).unwrap_err();
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Active);
    assert_eq!(device.memory_info().unwrap().free, free_active);
    assert_eq!(first_difference_in(&buffers), None);
    memory.pause(&tag).unwrap();
    memory.resume(&tag).unwrap();
    assert_eq!(first_difference_in(&buffers), None);
}

#[test]
fn parts_not_released_early_are_released_in_order_once_every_copy_is_done() {
    let (device, _memory) = faulty(64 * MIB, 2 * MIB);
    let device: Arc<dyn Device> = device;
    let run = device.reserve(8 * MIB).unwrap();
    device.commit(run).unwrap();
    let mut data = vec![0u8; run.len];
    ChaCha8Rng::seed_from_u64(53).fill_bytes(&mut data);
    device.write(&data, run).unwrap();
    let mut buffer = device.alloc_host(run.len).unwrap();
    let asked = AtomicUsize::new(0);
    let early = || asked.fetch_add(1, Ordering::SeqCst) < 2;
    let (released, copied) = copy_out_releasing(device.as_ref(), &[run], &mut buffer, early);
    copied.unwrap();
    assert_eq!(released, device.release_parts(run));
    assert_eq!(buffer.as_slice().unwrap(), &data[..]);
    assert!(
        device.release(run.slice(0, 2 * MIB).unwrap()).is_err(),
        "released already"
    );
    device.unreserve(run).unwrap();
}

#[test]
fn a_backup_offset_is_where_the_part_lies_in_the_saved_runs_laid_end_to_end() {
    let run = |start: u64, len: usize| AddressRange { start, len };
    let saved = [run(0x1000_0000, 4 * MIB), run(0x2000_0000, 2 * MIB)];
    assert_eq!(backup_offset(&saved, run(0x1000_0000, MIB)).unwrap(), 0);
    assert_eq!(
        backup_offset(&saved, run(0x1000_0000 + 2 * MIB as u64, 2 * MIB)).unwrap(),
        2 * MIB
    );
    assert_eq!(
        backup_offset(&saved, run(0x2000_0000 + MIB as u64, MIB)).unwrap(),
        5 * MIB
    );
    let outside = backup_offset(&saved, run(0x1000_0000 + 3 * MIB as u64, 2 * MIB));
    assert!(
        matches!(outside, Err(DeviceError::BadRange { .. })),
        "{outside:?}"
    );
}
