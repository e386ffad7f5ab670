//! Tests of the memory manager on the CPU device (and on the GPU with `MILES_TEST_DEVICE=cuda`).

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::device::open_test_device;
use crate::store::StoreError;

mod disk;

const MIB: usize = 1 << 20;

/// A manager on the test device: the CPU device, or GPU 0 limited to `capacity` with
/// `MILES_TEST_DEVICE=cuda` (see [`open_test_device`]).
fn manager(capacity: usize, dir: Option<&Path>) -> (Arc<dyn Device>, MemoryManager) {
    let device = open_test_device(capacity as u64).unwrap().shared();
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: dir.map(|dir| DiskSettings {
            dir: dir.to_path_buf(),
            rank: 0,
            chunk_bytes: MIB,
            host_budget_bytes: 0,
        }),
    };
    (
        Arc::clone(&device),
        MemoryManager::new(device, settings).unwrap(),
    )
}

/// Whether the test device lends host views of its memory (the CPU device does, CUDA not);
/// tests of views themselves skip without them.
fn has_host_views(test: &str) -> bool {
    let cpu = std::env::var("MILES_TEST_DEVICE").as_deref() != Ok("cuda");
    if !cpu {
        eprintln!("skipping {test}: host views exist on the cpu device only");
    }
    cpu
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

fn contents(buffer: &Buffer) -> Vec<u8> {
    let mut bytes = vec![0u8; buffer.len()];
    buffer.read(0, &mut bytes).unwrap();
    bytes
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn round_trips_are_bit_exact_at_the_same_addresses_for_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (_, memory) = manager(2048 * MIB, Some(dir.path()));
    let sizes = [
        1,
        255,
        3 * 4096 + 5,
        2 * MIB + 1,
        37 * MIB + 7,
        300 * MIB + 13,
    ];
    let data = random_bytes(7, sizes[sizes.len() - 1]);
    for policy in [BackupPolicy::Host, BackupPolicy::Disk, BackupPolicy::None] {
        let tag = MemoryTag::Named(format!("round-trip-{policy}"));
        memory
            .create_region(tag.clone(), policy, 512 * MIB)
            .unwrap();
        let mut buffers: Vec<Buffer> = sizes
            .iter()
            .map(|&len| memory.alloc(&tag, len).unwrap())
            .collect();
        for (buffer, &len) in buffers.iter_mut().zip(&sizes) {
            buffer.write(0, &data[..len]).unwrap();
        }
        let addresses: Vec<u64> = buffers.iter().map(Buffer::address).collect();
        let paused = memory.pause(&tag).unwrap();
        assert_eq!(paused.bytes, memory.region_bytes(&tag).unwrap());
        assert!(paused.free_after > paused.free_before);
        memory.resume(&tag).unwrap();
        assert_eq!(
            buffers.iter().map(Buffer::address).collect::<Vec<_>>(),
            addresses
        );
        if policy != BackupPolicy::None {
            for (buffer, &len) in buffers.iter().zip(&sizes) {
                let back = contents(buffer);
                let diff = first_difference(&back, &data[..len]);
                assert_eq!(diff, None, "{policy}: {len} bytes differ first at {diff:?}");
            }
        }
    }
    drop(memory);
    let left: Vec<_> = std::fs::read_dir(dir.path().join("offload/rank-0"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .filter(|name| name != "lock")
        .collect();
    assert!(
        left.is_empty(),
        "files left after verified resumes: {left:?}"
    );
}

#[test]
fn a_seeded_random_operation_sequence_matches_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let (_, memory) = manager(256 * MIB, Some(dir.path()));
    let policies = [BackupPolicy::Host, BackupPolicy::Disk, BackupPolicy::None];
    let tags: Vec<MemoryTag> = policies
        .iter()
        .map(|p| MemoryTag::Named(format!("model-{p}")))
        .collect();
    for (tag, &policy) in tags.iter().zip(&policies) {
        memory.create_region(tag.clone(), policy, 64 * MIB).unwrap();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    // (tag index, buffer, expected contents; None when a `none` pause dropped them)
    let mut live: Vec<(usize, Buffer, Option<Vec<u8>>)> = Vec::new();
    let mut paused = [false; 3];
    for step in 0..600 {
        let t = rng.random_range(0..3);
        match rng.random_range(0..10) {
            0..=2 => {
                let len = rng.random_range(1..300_000);
                match memory.alloc(&tags[t], len) {
                    Ok(buffer) => {
                        assert!(!paused[t], "step {step}: alloc in a paused tag");
                        live.push((t, buffer, None));
                    }
                    Err(MemoryError::TagPaused { .. }) => assert!(paused[t]),
                    Err(error) => panic!("step {step}: {error}"),
                }
            }
            3 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (bt, buffer, expected) = live.swap_remove(i);
                match buffer.free() {
                    Ok(()) => assert!(!paused[bt]),
                    Err(error) => {
                        assert!(paused[bt], "step {step}: {error}");
                        live.push((bt, error.buffer, expected));
                    }
                }
            }
            4..=5 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (bt, buffer, expected) = &mut live[i];
                let data = random_bytes(step, buffer.len());
                match buffer.write(0, &data) {
                    Ok(()) => *expected = Some(data),
                    Err(MemoryError::TagPaused { .. }) => assert!(paused[*bt]),
                    Err(error) => panic!("step {step}: {error}"),
                }
            }
            6 => {
                let report = memory.pause(&tags[t]);
                assert_eq!(report.is_ok(), !paused[t], "step {step}: {report:?}");
                if policies[t] == BackupPolicy::None {
                    live.iter_mut()
                        .filter(|(bt, _, _)| *bt == t)
                        .for_each(|(_, _, e)| *e = None);
                }
                paused[t] = true;
            }
            7 => {
                let report = memory.resume(&tags[t]);
                assert_eq!(report.is_ok(), paused[t], "step {step}: {report:?}");
                paused[t] = false;
            }
            _ => {}
        }
        for (bt, buffer, expected) in &live {
            if let (false, Some(expected)) = (paused[*bt], expected) {
                let back = contents(buffer);
                let diff = first_difference(&back, expected);
                assert_eq!(
                    diff, None,
                    "step {step}: tag {bt} differs first at {diff:?}"
                );
            }
        }
    }
}

#[test]
fn pause_drops_the_arena_resident_pages_for_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (device, memory) = manager(1024 * MIB, Some(dir.path()));
    for policy in [BackupPolicy::Host, BackupPolicy::Disk, BackupPolicy::None] {
        let tag = MemoryTag::Named(format!("resident-{policy}"));
        memory
            .create_region(tag.clone(), policy, 256 * MIB)
            .unwrap();
        let mut buffer = memory.alloc(&tag, 256 * MIB).unwrap();
        buffer.write(0, &random_bytes(3, 256 * MIB)).unwrap();
        let before = device.resident_bytes().unwrap();
        memory.pause(&tag).unwrap();
        let after = device.resident_bytes().unwrap();
        let dropped = before.saturating_sub(after);
        assert!(
            dropped as f64 >= 0.95 * (256 * MIB) as f64,
            "{policy}: resident {before} -> {after} bytes, dropped {dropped}"
        );
        memory.resume(&tag).unwrap();
    }
}

#[test]
fn pausing_one_tag_leaves_another_tags_bytes_intact() {
    let (_, memory) = manager(64 * MIB, None);
    memory
        .create_region(MemoryTag::KvCache, BackupPolicy::None, 8 * MIB)
        .unwrap();
    memory
        .create_region(MemoryTag::Weights, BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let mut kv = memory.alloc(&MemoryTag::KvCache, 1000).unwrap();
    let mut weights = memory.alloc(&MemoryTag::Weights, 1000).unwrap();
    let data = random_bytes(5, 1000);
    kv.write(0, &data).unwrap();
    weights.write(0, &data).unwrap();
    let (a, b) = (
        memory.arena(&MemoryTag::KvCache).unwrap(),
        memory.arena(&MemoryTag::Weights).unwrap(),
    );
    assert!(a.end() <= b.start || b.end() <= a.start, "arenas overlap");
    memory.pause(&MemoryTag::KvCache).unwrap();
    assert_eq!(contents(&weights), data);
    assert!(matches!(
        kv.read(0, &mut [0u8; 4]),
        Err(MemoryError::TagPaused { .. })
    ));
}

#[test]
fn misuse_of_the_state_machine_is_a_clear_error() {
    let (_, memory) = manager(64 * MIB, None);
    let tag = MemoryTag::Params;
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 4096).unwrap();
    let data = random_bytes(9, 4096);
    buffer.write(0, &data).unwrap();
    assert!(matches!(
        memory.resume(&tag),
        Err(MemoryError::NotPaused { .. })
    ));
    memory.pause(&tag).unwrap();
    assert!(matches!(
        memory.pause(&tag),
        Err(MemoryError::AlreadyPaused { .. })
    ));
    assert!(matches!(
        buffer.view::<f32>(),
        Err(MemoryError::TagPaused { .. })
    ));
    assert!(matches!(
        buffer.write(0, &data),
        Err(MemoryError::TagPaused { .. })
    ));
    assert!(matches!(
        memory.alloc(&tag, 16),
        Err(MemoryError::TagPaused { .. })
    ));
    let error = buffer.free().unwrap_err();
    assert!(
        matches!(error.error, MemoryError::TagPaused { .. }),
        "{error}"
    );
    let buffer = error.buffer;
    memory.resume(&tag).unwrap();
    assert_eq!(first_difference(&contents(&buffer), &data), None);
    buffer.free().unwrap();
    assert!(matches!(
        memory.state(&MemoryTag::Grads),
        Err(MemoryError::UnknownTag { .. })
    ));
    assert!(matches!(
        memory.create_region(MemoryTag::Named("../x".into()), BackupPolicy::None, MIB),
        Err(MemoryError::InvalidTagName { .. })
    ));
    assert!(matches!(
        memory.create_region(MemoryTag::Optimizer, BackupPolicy::Disk, MIB),
        Err(MemoryError::NoDiskStore { .. })
    ));
}

#[test]
fn pause_waits_for_views_and_refuses_new_ones_meanwhile() {
    if !has_host_views("pause_waits_for_views_and_refuses_new_ones_meanwhile") {
        return;
    }
    let (_, memory) = manager(64 * MIB, None);
    let tag = MemoryTag::Activations;
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let mut first = memory.alloc(&tag, 4096).unwrap();
    let second = memory.alloc(&tag, 4096).unwrap();
    let values: Vec<f32> = (0..1024).map(|i| i as f32 * 0.5 + 1.0).collect();
    first.view_mut::<f32>().unwrap().copy_from_slice(&values);
    let view = first.view::<f32>().unwrap();
    std::thread::scope(|scope| {
        let pauser = scope.spawn(|| memory.pause(&tag));
        while memory.state(&tag).unwrap() != RegionState::Pausing {
            std::thread::yield_now();
        }
        assert!(matches!(
            second.view::<f32>(),
            Err(MemoryError::TagBusy { .. })
        ));
        assert!(
            !pauser.is_finished(),
            "pause finished while a view was alive"
        );
        assert_eq!(&view[..], values.as_slice());
        drop(view);
        pauser.join().unwrap().unwrap();
    });
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
    memory.resume(&tag).unwrap();
    assert_eq!(&first.view::<f32>().unwrap()[..], values.as_slice());
}

/// Device work that completes when the test opens the gate.
struct Gate(std::sync::atomic::AtomicBool);

impl crate::device::PendingWork for Gate {
    fn wait(&self) -> Result<(), crate::device::DeviceError> {
        while !self.0.load(std::sync::atomic::Ordering::Acquire) {
            std::thread::yield_now();
        }
        Ok(())
    }

    fn is_done(&self) -> Result<bool, crate::device::DeviceError> {
        Ok(self.0.load(std::sync::atomic::Ordering::Acquire))
    }
}

#[test]
fn pause_waits_for_device_work_recorded_on_the_tag() {
    let (_, memory) = manager(64 * MIB, None);
    let tag = MemoryTag::KvCache;
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let buffer = memory.alloc(&tag, 4096).unwrap();
    let gate = Arc::new(Gate(std::sync::atomic::AtomicBool::new(false)));
    buffer.record_use(crate::device::Fence::pending(gate.clone()));
    std::thread::scope(|scope| {
        let pauser = scope.spawn(|| memory.pause(&tag));
        while memory.state(&tag).unwrap() != RegionState::Pausing {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !pauser.is_finished(),
            "pause finished while device work was in flight"
        );
        assert_eq!(memory.region_bytes(&tag).unwrap(), 2 * MIB as u64);
        gate.0.store(true, std::sync::atomic::Ordering::Release);
        pauser.join().unwrap().unwrap();
    });
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
}

#[test]
fn one_tag_pauses_and_resumes_while_another_is_in_use() {
    let (_, memory) = manager(256 * MIB, None);
    memory
        .create_region(MemoryTag::Params, BackupPolicy::Host, 16 * MIB)
        .unwrap();
    memory
        .create_region(MemoryTag::Weights, BackupPolicy::Host, 16 * MIB)
        .unwrap();
    let mut params = memory.alloc(&MemoryTag::Params, 4 * MIB).unwrap();
    let mut weights = memory.alloc(&MemoryTag::Weights, 4 * MIB).unwrap();
    let params_data = random_bytes(29, 4 * MIB);
    params.write(0, &params_data).unwrap();
    weights.write(0, &random_bytes(31, 4 * MIB)).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..50 {
                memory.pause(&MemoryTag::Params).unwrap();
                memory.resume(&MemoryTag::Params).unwrap();
            }
        });
        let mut block = random_bytes(31, 4 * MIB);
        for round in 0..200u8 {
            block.iter_mut().for_each(|x| *x = x.wrapping_add(round));
            weights.write(0, &block).unwrap();
            assert_eq!(first_difference(&contents(&weights), &block), None);
        }
    });
    assert_eq!(first_difference(&contents(&params), &params_data), None);
    let pooled = memory.host_pool().allocated_bytes();
    assert!(pooled >= 4 * MIB as u64);
    assert_eq!(
        memory.release_host_pool(),
        pooled,
        "the pool frees on request"
    );
}

#[test]
fn host_backups_prepared_up_front_are_what_the_first_pause_uses() {
    let (_, memory) = manager(64 * MIB, None);
    memory
        .create_region(MemoryTag::Params, BackupPolicy::Host, 16 * MIB)
        .unwrap();
    memory
        .create_region(MemoryTag::Grads, BackupPolicy::None, 16 * MIB)
        .unwrap();
    let mut params = memory.alloc(&MemoryTag::Params, 3 * MIB + 5).unwrap();
    let _grads = memory.alloc(&MemoryTag::Grads, MIB).unwrap();
    let data = random_bytes(7, 3 * MIB + 5);
    params.write(0, &data).unwrap();
    let prepared = memory
        .prepare_host_backups(&[MemoryTag::Params, MemoryTag::Grads])
        .unwrap();
    assert!(
        prepared >= (3 * MIB + 5) as u64,
        "{prepared} bytes prepared"
    );
    assert_eq!(memory.host_pool().allocated_bytes(), prepared);
    memory.pause(&MemoryTag::Params).unwrap();
    assert_eq!(
        memory.host_pool().allocated_bytes(),
        prepared,
        "the pause took the prepared buffer instead of growing the pool"
    );
    memory.resume(&MemoryTag::Params).unwrap();
    assert_eq!(first_difference(&contents(&params), &data), None);
}

#[test]
fn a_tag_with_nothing_committed_pauses_without_holding_a_host_buffer() {
    let (_, memory) = manager(64 * MIB, None);
    for tag in [MemoryTag::Params, MemoryTag::Optimizer] {
        memory
            .create_region(tag, BackupPolicy::Host, 16 * MIB)
            .unwrap();
    }
    let mut params = memory.alloc(&MemoryTag::Params, 3 * MIB).unwrap();
    let data = random_bytes(8, 3 * MIB);
    params.write(0, &data).unwrap();
    memory.pause(&MemoryTag::Params).unwrap();
    memory.resume(&MemoryTag::Params).unwrap();
    let pooled = memory.host_pool().allocated_bytes();
    // The optimizer's region is empty (its state streams through the disk, say): its pause
    // leaves the pool's free buffer to the next pause of params.
    memory.pause(&MemoryTag::Optimizer).unwrap();
    memory.pause(&MemoryTag::Params).unwrap();
    assert_eq!(
        memory.host_pool().allocated_bytes(),
        pooled,
        "the empty tag's pause took the pooled buffer, so params' pause grew the pool"
    );
    memory.resume(&MemoryTag::Optimizer).unwrap();
    memory.resume(&MemoryTag::Params).unwrap();
    assert_eq!(first_difference(&contents(&params), &data), None);
}

#[test]
fn resume_without_memory_changes_nothing_and_succeeds_after_another_tag_pauses() {
    let (_, memory) = manager(64 * MIB, None);
    memory
        .create_region(MemoryTag::Weights, BackupPolicy::Host, 64 * MIB)
        .unwrap();
    memory
        .create_region(MemoryTag::KvCache, BackupPolicy::None, 64 * MIB)
        .unwrap();
    let mut weights = memory.alloc(&MemoryTag::Weights, 32 * MIB).unwrap();
    let data = random_bytes(11, 32 * MIB);
    weights.write(0, &data).unwrap();
    memory.pause(&MemoryTag::Weights).unwrap();
    let kv = memory.alloc(&MemoryTag::KvCache, 40 * MIB).unwrap();
    let error = memory.resume(&MemoryTag::Weights).unwrap_err();
    assert!(
        matches!(error, MemoryError::InsufficientMemory { need, free, .. } if need == 32 * MIB as u64 && free == 24 * MIB as u64),
        "{error}"
    );
    assert_eq!(
        memory.state(&MemoryTag::Weights).unwrap(),
        RegionState::Paused
    );
    memory.pause(&MemoryTag::KvCache).unwrap();
    memory.resume(&MemoryTag::Weights).unwrap();
    assert_eq!(first_difference(&contents(&weights), &data), None);
    drop(kv);
}

#[test]
fn buffers_dropped_while_paused_are_freed_on_resume() {
    let (_, memory) = manager(64 * MIB, None);
    let tag = MemoryTag::Grads;
    memory
        .create_region(tag.clone(), BackupPolicy::None, 16 * MIB)
        .unwrap();
    let buffers: HashMap<usize, Buffer> = (0..4)
        .map(|i| (i, memory.alloc(&tag, 3 * MIB).unwrap()))
        .collect();
    memory.pause(&tag).unwrap();
    drop(buffers);
    memory.resume(&tag).unwrap();
    assert_eq!(memory.region_bytes(&tag).unwrap(), 0);
    assert!(memory.alloc(&tag, 16 * MIB).is_ok());
}

/// Three tags with seeded random contents, the third of `third`'s policy.
fn three_tags(memory: &MemoryManager, third: BackupPolicy) -> Vec<(MemoryTag, Buffer, Vec<u8>)> {
    ["first", "second", "third"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let tag = MemoryTag::Named(format!("all-{name}"));
            let policy = if i == 2 { third } else { BackupPolicy::Host };
            memory.create_region(tag.clone(), policy, 8 * MIB).unwrap();
            let mut buffer = memory.alloc(&tag, 3 * MIB + 5).unwrap();
            let data = random_bytes(40 + i as u64, 3 * MIB + 5);
            buffer.write(0, &data).unwrap();
            (tag, buffer, data)
        })
        .collect()
}

#[test]
fn pause_all_failing_on_the_third_tag_leaves_the_first_two_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut memory) = manager(64 * MIB, Some(dir.path()));
    memory.inject_disk_write_fault(1);
    let tags = three_tags(&memory, BackupPolicy::Disk);
    let names: Vec<MemoryTag> = tags.iter().map(|(tag, _, _)| tag.clone()).collect();
    let error = memory.pause_all(&names).unwrap_err();
    assert!(
        matches!(error, MemoryError::Store { ref tag, .. } if *tag == names[2]),
        "{error}"
    );
    for (tag, buffer, data) in &tags {
        assert_eq!(memory.state(tag).unwrap(), RegionState::Active, "{tag}");
        let got = contents(buffer);
        assert_eq!(first_difference(&got, data), None, "{tag} changed");
    }
    let reports = memory.pause_all(&names[..2]).unwrap();
    assert_eq!(
        reports.iter().map(|r| r.tag.clone()).collect::<Vec<_>>(),
        names[..2]
    );
}

#[test]
fn resume_all_failing_on_the_third_tag_pauses_the_first_two_again_and_can_retry() {
    let device = Arc::new(crate::device::FaultyDevice::over(
        open_test_device(64 * MIB as u64).unwrap().shared(),
        0,
    ));
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = MemoryManager::new(Arc::clone(&device) as Arc<dyn Device>, settings).unwrap();
    let tags = three_tags(&memory, BackupPolicy::Host);
    let names: Vec<MemoryTag> = tags.iter().map(|(tag, _, _)| tag.clone()).collect();
    memory.pause_all(&names).unwrap();
    device
        .fail_commit_in
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let error = memory.resume_all(&names).unwrap_err();
    assert!(
        matches!(error, MemoryError::Device { ref tag, .. } if *tag == names[2]),
        "{error}"
    );
    for tag in &names {
        assert_eq!(memory.state(tag).unwrap(), RegionState::Paused, "{tag}");
    }
    let reports = memory.resume_all(&names).unwrap();
    assert_eq!(reports.len(), 3);
    for (tag, buffer, data) in &tags {
        let got = contents(buffer);
        assert_eq!(first_difference(&got, data), None, "{tag} lost bytes");
    }
}

#[test]
fn a_host_backup_address_exists_only_while_a_host_backed_tag_is_paused() {
    let (_, memory) = manager(64 * MIB, None);
    let host = MemoryTag::Named("host-backed".to_string());
    let dropped = MemoryTag::Named("dropped".to_string());
    memory
        .create_region(host.clone(), BackupPolicy::Host, 16 * MIB)
        .unwrap();
    memory
        .create_region(dropped.clone(), BackupPolicy::None, 16 * MIB)
        .unwrap();
    let first = memory.alloc(&host, 3 * MIB).unwrap();
    let second = memory.alloc(&host, MIB).unwrap();
    let other = memory.alloc(&dropped, MIB).unwrap();
    assert_eq!(
        memory.host_backup_address(&host, first.range()).unwrap(),
        None
    );
    memory.pause(&host).unwrap();
    memory.pause(&dropped).unwrap();
    let at_first = memory.host_backup_address(&host, first.range()).unwrap();
    let at_second = memory.host_backup_address(&host, second.range()).unwrap();
    let (Some(at_first), Some(at_second)) = (at_first, at_second) else {
        panic!("a paused host-backed tag has a backup address for each buffer");
    };
    assert_eq!(
        at_second - at_first,
        (second.address() - first.address()) as usize,
        "the backup holds the buffers at their distance on the device"
    );
    assert_eq!(
        memory.host_backup_address(&dropped, other.range()).unwrap(),
        None
    );
    let outside = AddressRange {
        start: memory.arena(&host).unwrap().end() - MIB as u64,
        len: MIB,
    };
    assert_eq!(memory.host_backup_address(&host, outside).unwrap(), None);
    memory.resume(&host).unwrap();
    assert_eq!(
        memory.host_backup_address(&host, first.range()).unwrap(),
        None
    );
}

#[test]
fn pausing_a_tag_while_this_thread_holds_a_view_is_an_error_naming_it() {
    if !has_host_views("pausing_a_tag_while_this_thread_holds_a_view_is_an_error_naming_it") {
        return;
    }
    let (_, memory) = manager(64 * MIB, None);
    let tag = MemoryTag::Named("viewed".to_string());
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 4096).unwrap();
    buffer.write(0, &random_bytes(61, 4096)).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let view = buffer.view::<u8>().unwrap();
            let result = memory.pause(&tag);
            drop(view);
            done.send(result).unwrap();
        });
        let result = finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("pause blocked on the calling thread's own view");
        match result {
            Err(error @ MemoryError::ViewHeld { views: 1, .. }) => {
                assert!(error.to_string().contains("viewed"), "{error}");
            }
            other => panic!("want ViewHeld, got {other:?}"),
        }
    });
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Active);
    memory.pause(&tag).unwrap();
    memory.resume(&tag).unwrap();
}

#[test]
fn sizes_that_overflow_are_errors_naming_the_value() {
    let (_, memory) = manager(64 * MIB, None);
    let error = memory
        .create_region(
            MemoryTag::Named("huge".into()),
            BackupPolicy::None,
            usize::MAX,
        )
        .unwrap_err();
    assert!(
        matches!(error, MemoryError::SizeOverflow { value, .. } if value == usize::MAX as u64),
        "{error}"
    );
    assert!(
        error.to_string().contains(&usize::MAX.to_string()),
        "{error}"
    );
    let tag = MemoryTag::Named("small".into());
    memory
        .create_region(tag.clone(), BackupPolicy::None, 4 * MIB)
        .unwrap();
    for len in [usize::MAX, usize::MAX - 100] {
        let error = memory.alloc(&tag, len).unwrap_err();
        assert!(
            matches!(error, MemoryError::SizeOverflow { .. }),
            "alloc of {len}: {error}"
        );
    }
    let error = memory.alloc(&tag, usize::MAX / 2).unwrap_err();
    assert!(matches!(error, MemoryError::ArenaFull { .. }), "{error}");
}
