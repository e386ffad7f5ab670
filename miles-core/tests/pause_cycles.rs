//! Many pause/resume cycles of one tag keep host memory bounded (a process of its own, so the
//! resident set is not disturbed by other tests). On the CPU device, or on GPU 0 with
//! `MILES_TEST_DEVICE=cuda`.

// Helpers of a test crate are test code: they may unwrap (clippy.toml covers only `#[test]`
// functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used)]

use miles_core::device::open_test_device;
use miles_core::{BackupPolicy, ManagerSettings, MemoryManager, MemoryTag};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MIB: usize = 1 << 20;

fn resident_set_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn a_thousand_pause_resume_cycles_do_not_grow_resident_memory_past_the_pool() {
    let device = open_test_device(256 * MIB as u64).unwrap().shared();
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = MemoryManager::new(device, settings).unwrap();
    let tag = MemoryTag::Weights;
    memory
        .create_region(tag.clone(), BackupPolicy::Host, 8 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 4 * MIB - 100).unwrap();
    let mut data = vec![0u8; buffer.len()];
    ChaCha8Rng::seed_from_u64(23).fill_bytes(&mut data);
    buffer.write(0, &data).unwrap();
    for _ in 0..10 {
        memory.pause(&tag).unwrap();
        memory.resume(&tag).unwrap();
    }
    let pool_high_water = memory.host_pool().allocated_bytes();
    let warm = resident_set_bytes();
    for _ in 0..1000 {
        memory.pause(&tag).unwrap();
        memory.resume(&tag).unwrap();
    }
    let after = resident_set_bytes();
    assert_eq!(memory.host_pool().allocated_bytes(), pool_high_water);
    // Tolerance: one page-table page and the test harness's own allocations, 1 MiB.
    assert!(
        after <= warm + MIB as u64,
        "resident set grew from {warm} to {after} bytes over 1000 cycles (pool {pool_high_water})"
    );
    let mut back = vec![0u8; data.len()];
    buffer.read(0, &mut back).unwrap();
    assert!(back == data, "bytes changed over 1000 cycles");
}
