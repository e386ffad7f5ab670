//! Tests of the drop-in's memory on the CPU device.

use std::path::Path;

use miles_core::{CpuDevice, DeviceKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

const MIB: usize = 1 << 20;

/// A saver over CPU devices of `capacity` bytes, disk backups under `dir`.
fn saver(capacity: u64, dir: &Path) -> Saver {
    let settings = SaverSettings {
        disk_dir: dir.to_path_buf(),
        chunk_bytes: MIB,
        retain_cpu_backup: true,
    };
    Saver::new(
        settings,
        Box::new(move |_| {
            Ok(Opened {
                device: Arc::new(CpuDevice::new(capacity)),
                cuda: None,
            })
        }),
    )
}

fn region(tag: &str, policy: BackupPolicy) -> RegionConfig {
    RegionConfig {
        tag: tag.to_string(),
        policy,
    }
}

fn device(saver: &Saver) -> Arc<dyn Device> {
    Arc::clone(saver.gpu(0).unwrap().memory.device())
}

/// Allocate `len` bytes for `config` and fill them with seeded random bytes.
fn filled(saver: &Saver, config: &RegionConfig, len: usize, seed: u64) -> (u64, Vec<u8>) {
    let address = saver.alloc(0, len, config).unwrap();
    let mut data = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut data);
    device(saver)
        .write(
            &data,
            AddressRange {
                start: address,
                len,
            },
        )
        .unwrap();
    (address, data)
}

fn read(saver: &Saver, address: u64, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    device(saver)
        .read(
            AddressRange {
                start: address,
                len,
            },
            &mut back,
        )
        .unwrap();
    back
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn free_bytes(saver: &Saver) -> u64 {
    device(saver).memory_info().unwrap().free
}

#[test]
fn cpu_and_disk_backups_resume_bit_exact_at_the_same_addresses_and_none_frees_only() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(256 << 20, dir.path());
    let host = region("weights", BackupPolicy::Host);
    let disk = region("optimizer", BackupPolicy::Disk);
    let dropped = region("kv_cache", BackupPolicy::None);
    let (host_at, host_data) = filled(&saver, &host, 5 * MIB + 17, 1);
    let (disk_at, disk_data) = filled(&saver, &disk, 3 * MIB + 5, 2);
    let (kv_at, _) = filled(&saver, &dropped, 4 * MIB, 3);
    assert_eq!(device(&saver).kind(), DeviceKind::Cpu);
    for cycle in 0..3 {
        let before = free_bytes(&saver);
        saver.pause(None).unwrap();
        let freed = free_bytes(&saver) - before;
        assert!(
            freed >= (12 * MIB) as u64,
            "cycle {cycle}: a pause of every tag frees their bytes, freed {freed}"
        );
        saver.resume(None).unwrap();
        assert_eq!(free_bytes(&saver), before, "cycle {cycle}");
        let diff = first_difference(&read(&saver, host_at, host_data.len()), &host_data);
        assert_eq!(
            diff, None,
            "cycle {cycle}: first byte of the cpu backup differing"
        );
        let diff = first_difference(&read(&saver, disk_at, disk_data.len()), &disk_data);
        assert_eq!(
            diff, None,
            "cycle {cycle}: first byte of the disk backup differing"
        );
    }
    saver.pause(Some("kv_cache")).unwrap();
    saver.resume(Some("kv_cache")).unwrap();
    assert_eq!(read(&saver, kv_at, 16).len(), 16);
}

#[test]
fn each_tag_and_policy_lives_in_its_own_arena_and_pauses_alone() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(256 << 20, dir.path());
    let weights = region("weights", BackupPolicy::Host);
    let weights_dropped = region("weights", BackupPolicy::None);
    let kv = region("kv_cache", BackupPolicy::Host);
    let (w_at, w_data) = filled(&saver, &weights, MIB, 4);
    let (wd_at, _) = filled(&saver, &weights_dropped, MIB, 5);
    let (kv_at, kv_data) = filled(&saver, &kv, MIB, 6);
    let gpu = saver.gpu(0).unwrap();
    let arenas: Vec<AddressRange> = gpu
        .matching(None)
        .iter()
        .map(|tag| gpu.memory.arena(tag).unwrap())
        .collect();
    assert_eq!(arenas.len(), 3, "one region per tag and policy");
    for (at, arena) in [w_at, wd_at, kv_at].iter().zip(&arenas) {
        assert!(
            arena.start <= *at && *at < arena.end(),
            "{at:#x} in {arena:?}"
        );
    }
    saver.pause(Some("weights")).unwrap();
    assert_eq!(
        read(&saver, kv_at, MIB),
        kv_data,
        "another tag is untouched"
    );
    assert_eq!(
        gpu.memory.state(&gpu.matching(Some("weights"))[1]).unwrap(),
        RegionState::Paused,
        "every policy of the tag pauses"
    );
    saver.resume(Some("weights")).unwrap();
    assert_eq!(first_difference(&read(&saver, w_at, MIB), &w_data), None);
}

#[test]
fn misuse_of_pause_and_resume_is_an_error_and_unknown_tags_are_no_ops() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    saver.pause(Some("never-allocated")).unwrap();
    saver.resume(Some("never-allocated")).unwrap();
    filled(&saver, &region("weights", BackupPolicy::Host), MIB, 7);
    let error = saver.resume(Some("weights")).unwrap_err();
    assert!(error.to_string().contains("not paused"), "{error}");
    saver.pause(Some("weights")).unwrap();
    let error = saver.pause(Some("weights")).unwrap_err();
    assert!(error.to_string().contains("paused already"), "{error}");
    saver.pause(None).unwrap();
    saver.resume(None).unwrap();
    saver.resume(None).unwrap();
}

#[test]
fn a_resume_without_room_for_the_margin_changes_nothing_and_succeeds_later() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    let (at, data) = filled(&saver, &region("weights", BackupPolicy::Host), 8 * MIB, 8);
    saver.pause(Some("weights")).unwrap();
    let free = free_bytes(&saver);
    saver.set_margin(free);
    let error = saver.resume(Some("weights")).unwrap_err();
    assert!(
        matches!(error, TorchError::InsufficientMemory { .. }),
        "{error}"
    );
    assert_eq!(free_bytes(&saver), free, "nothing was committed");
    assert!(
        saver.cpu_backup_address(at, 16).is_some(),
        "the tag is still paused with its backup"
    );
    saver.set_margin(0);
    saver.resume(Some("weights")).unwrap();
    assert_eq!(first_difference(&read(&saver, at, data.len()), &data), None);
}

#[test]
fn an_allocation_that_would_eat_into_the_margin_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    let config = region("kv_cache", BackupPolicy::None);
    saver.alloc(0, MIB, &config).unwrap();
    saver.set_margin(60 << 20);
    let error = saver.alloc(0, 8 * MIB, &config).unwrap_err();
    assert!(matches!(error, TorchError::Margin { .. }), "{error}");
    saver.set_margin(0);
    saver.alloc(0, 8 * MIB, &config).unwrap();
}

#[test]
fn a_free_of_a_paused_allocation_takes_effect_at_resume_and_others_stay_intact() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    let config = region("weights", BackupPolicy::Host);
    let (gone, _) = filled(&saver, &config, 4 * MIB, 9);
    let (kept, data) = filled(&saver, &config, 2 * MIB, 10);
    let active = free_bytes(&saver);
    saver.pause(Some("weights")).unwrap();
    assert!(saver.free(gone).unwrap(), "the address is a tag's");
    assert!(!saver.free(gone).unwrap(), "and is not once freed");
    saver.resume(Some("weights")).unwrap();
    assert_eq!(free_bytes(&saver), active + (4 * MIB) as u64);
    assert_eq!(
        first_difference(&read(&saver, kept, data.len()), &data),
        None
    );
    assert!(!saver.free(0xdead_0000).unwrap(), "not a tag's address");
}

#[test]
fn a_cpu_backup_address_exists_only_while_paused_with_a_cpu_backup() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    let (host_at, _) = filled(&saver, &region("weights", BackupPolicy::Host), 2 * MIB, 11);
    let (disk_at, _) = filled(&saver, &region("grads", BackupPolicy::Disk), 2 * MIB, 12);
    assert_eq!(saver.cpu_backup_address(host_at, 1024), None, "active");
    saver.pause(None).unwrap();
    let first = saver.cpu_backup_address(host_at, 1024).unwrap();
    let later = saver.cpu_backup_address(host_at + 4096, 1024).unwrap();
    assert_eq!(later - first, 4096);
    assert_eq!(saver.cpu_backup_address(disk_at, 1024), None, "disk backup");
    assert_eq!(
        saver.cpu_backup_address(host_at, (4 * MIB) as u64),
        None,
        "past the allocation"
    );
    saver.resume(None).unwrap();
    assert_eq!(saver.cpu_backup_address(host_at, 1024), None);
}

#[test]
fn a_corrupted_disk_chunk_fails_the_resume_and_keeps_the_tag_paused() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    let config = region("optimizer", BackupPolicy::Disk);
    let (at, data) = filled(&saver, &config, 3 * MIB, 13);
    saver.pause(Some("optimizer")).unwrap();
    let file = find_file(dir.path(), "data.bin").expect("the pause wrote a data file");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[MIB + 7] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let error = saver.resume(Some("optimizer")).unwrap_err();
    assert!(error.to_string().contains("checksum"), "{error}");
    bytes[MIB + 7] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    saver.resume(Some("optimizer")).unwrap();
    assert_eq!(first_difference(&read(&saver, at, data.len()), &data), None);
}

fn find_file(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

#[test]
fn the_disk_directory_is_fixed_once_memory_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    saver.set_disk_dir(dir.path().join("other")).unwrap();
    filled(&saver, &region("weights", BackupPolicy::None), MIB, 14);
    saver.set_disk_dir(dir.path().join("other")).unwrap();
    let error = saver.set_disk_dir(dir.path().to_path_buf()).unwrap_err();
    assert!(matches!(error, TorchError::DiskDirFixed { .. }), "{error}");
}

#[test]
fn region_names_keep_tags_apart_in_the_characters_regions_allow() {
    let name = region_name(&region("Model Weights!", BackupPolicy::Host), 3);
    assert_eq!(name, "model_weights_-host-3");
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    filled(&saver, &region("Type1", BackupPolicy::None), MIB, 15);
    filled(&saver, &region("type1", BackupPolicy::None), MIB, 16);
    saver.pause(Some("Type1")).unwrap();
    let gpu = saver.gpu(0).unwrap();
    let lower = gpu.matching(Some("type1"));
    assert_eq!(gpu.memory.state(&lower[0]).unwrap(), RegionState::Active);
}

#[test]
fn a_tag_whose_allocations_were_all_freed_pauses_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(64 << 20, dir.path());
    for (tag, policy) in [
        ("weights", BackupPolicy::Host),
        ("optimizer", BackupPolicy::Disk),
        ("kv_cache", BackupPolicy::None),
    ] {
        let (address, _) = filled(&saver, &region(tag, policy), MIB, 17);
        assert!(saver.free(address).unwrap());
    }
    for cycle in 0..2 {
        saver
            .pause(None)
            .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        saver
            .resume(None)
            .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
    }
}

#[test]
fn a_prepared_cpu_backup_is_pinned_before_the_first_pause_which_then_takes_no_new_memory() {
    let dir = tempfile::tempdir().unwrap();
    let saver = saver(256 << 20, dir.path());
    let host = region("weights", BackupPolicy::Host);
    let (at, data) = filled(&saver, &host, 6 * MIB + 3, 11);
    filled(&saver, &region("weights", BackupPolicy::None), MIB, 12);
    let pool = || saver.gpu(0).unwrap().memory.host_pool().allocated_bytes();
    assert_eq!(pool(), 0, "nothing is pinned while the region is open");
    let grown = saver.prepare_cpu_backup("weights").unwrap();
    assert!(
        grown >= (6 * MIB) as u64 && grown == pool(),
        "the pool holds the cpu-backed bytes of the tag (and only those): grew {grown}"
    );
    assert_eq!(
        saver.prepare_cpu_backup("weights").unwrap(),
        0,
        "a second call finds the buffer it made"
    );
    assert_eq!(
        saver.prepare_cpu_backup("kv_cache").unwrap(),
        0,
        "no such tag"
    );
    saver.pause(Some("weights")).unwrap();
    assert_eq!(
        pool(),
        grown,
        "the first pause copies into the buffer pinned up front"
    );
    saver.resume(Some("weights")).unwrap();
    assert_eq!(first_difference(&read(&saver, at, data.len()), &data), None);
}
