//! Tests of the CUDA device. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-core
//! -- --test-threads=1` (the memory manager's suite then runs on the GPU too); elsewhere each
//! test prints a skip note and returns. These tests take the GPU in turn (one lock), since
//! out-of-memory and free-memory checks need it to themselves.

use std::sync::{Mutex, MutexGuard, PoisonError};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

static GPU: Mutex<()> = Mutex::new(());

/// The GPU, to this test alone, when `MILES_TEST_DEVICE=cuda`; `None` (with a note) otherwise.
fn gpu(test: &str) -> Option<(MutexGuard<'static, ()>, CudaDevice)> {
    if std::env::var("MILES_TEST_DEVICE").as_deref() != Ok("cuda") {
        eprintln!("skipping {test}: set MILES_TEST_DEVICE=cuda to run it on a gpu");
        return None;
    }
    let guard = GPU.lock().unwrap_or_else(PoisonError::into_inner);
    let device = CudaDevice::open(0)
        .unwrap_or_else(|error| panic!("MILES_TEST_DEVICE=cuda but cuda:0 cannot open: {error}"));
    Some((guard, device))
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn ok<T>(result: Result<T, DeviceError>, what: &str) -> T {
    result.unwrap_or_else(|error| panic!("{what}: {error}"))
}

/// Reserve and commit `len` bytes (rounded up to granules).
fn committed(device: &CudaDevice, len: usize) -> AddressRange {
    let granule_len = len.max(1).next_multiple_of(device.granularity());
    let range = ok(device.reserve(granule_len), "reserve");
    ok(device.commit(range), "commit");
    range
}

#[test]
fn open_without_a_driver_reports_cuda_unavailable() {
    if crate::device::probe::cudarc_driver_ready().is_ok() {
        eprintln!("skipping open_without_a_driver_reports_cuda_unavailable: a cuda driver is here");
        return;
    }
    match CudaDevice::open(0) {
        Err(DeviceError::CudaUnavailable(reason)) => assert!(!reason.is_empty()),
        other => panic!("expected CudaUnavailable without a driver, got {other:?}"),
    }
}

#[test]
fn cuda_round_trip_through_pinned_memory_is_bit_exact_at_the_same_address() {
    let Some((_gpu, device)) = gpu("cuda_round_trip_through_pinned_memory") else {
        return;
    };
    let granule = device.granularity();
    let sizes = [
        1,
        4099,
        granule,
        3 * granule + 12345,
        64 * MIB + 7,
        GIB,
        3 * GIB,
    ];
    for (index, &len) in sizes.iter().enumerate() {
        let data = random_bytes(len, 17 + index as u64);
        let range = committed(&device, len);
        let bytes = ok(range.slice(0, len), "slice");
        let mut host = ok(device.alloc_host(len), "alloc_host");
        assert!(host.is_pinned());
        ok(host.as_mut_slice(), "host bytes").copy_from_slice(&data);
        ok(
            ok(device.copy_from_host(&mut host, 0, bytes), "copy in").wait(),
            "wait in",
        );
        // Pause: copy out, release; resume: commit the same addresses, copy back.
        let mut backup = ok(device.alloc_host(len), "alloc_host");
        ok(
            ok(device.copy_to_host(bytes, &mut backup, 0), "copy out").wait(),
            "wait out",
        );
        ok(device.release(range), "release");
        ok(device.commit(range), "commit again");
        ok(
            ok(device.copy_from_host(&mut backup, 0, bytes), "copy back").wait(),
            "wait back",
        );
        let mut back = vec![0u8; len];
        ok(device.read(bytes, &mut back), "read");
        let worst = first_difference(&back, &data);
        assert!(
            worst.is_none(),
            "{len} bytes: first difference at byte {worst:?} (tolerance: none)"
        );
        ok(device.unreserve(range), "unreserve");
    }
}

#[test]
fn cuda_release_frees_at_least_99_5_percent_of_the_range() {
    let Some((_gpu, device)) = gpu("cuda_release_frees_at_least_99_5_percent_of_the_range") else {
        return;
    };
    let len = 4 * GIB;
    let range = committed(&device, len);
    ok(device.write(&random_bytes(len, 5), range), "write");
    let before = ok(device.memory_info(), "memory_info").free;
    ok(device.release(range), "release");
    let after = ok(device.memory_info(), "memory_info").free;
    let freed = after.saturating_sub(before);
    eprintln!("released {len} bytes, free memory rose by {freed}");
    assert!(freed as f64 >= 0.995 * len as f64, "freed {freed} of {len}");
    ok(device.unreserve(range), "unreserve");
}

#[test]
fn cuda_commit_beyond_capacity_is_out_of_memory_and_commits_nothing() {
    let Some((_gpu, device)) = gpu("cuda_commit_beyond_capacity_is_out_of_memory") else {
        return;
    };
    let info = ok(device.memory_info(), "memory_info");
    let len = (info.total as usize + GIB).next_multiple_of(device.granularity());
    let range = ok(device.reserve(len), "reserve");
    match device.commit(range) {
        Err(DeviceError::OutOfMemory { requested, .. }) => assert_eq!(requested, len as u64),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let after = ok(device.memory_info(), "memory_info").free;
    let lost = info.free.saturating_sub(after);
    assert!(lost < 64 * MIB as u64, "a failed commit kept {lost} bytes");
    let granule = ok(range.slice(0, device.granularity()), "slice");
    let mut byte = [0u8; 1];
    assert!(
        device
            .read(ok(granule.slice(0, 1), "slice"), &mut byte)
            .is_err()
    );
    ok(
        device.commit(granule),
        "a small commit after the failed one",
    );
    ok(device.unreserve(range), "unreserve");
}

#[test]
fn cuda_copies_of_uncommitted_or_released_ranges_are_errors() {
    let Some((_gpu, device)) = gpu("cuda_copies_of_uncommitted_or_released_ranges_are_errors")
    else {
        return;
    };
    let granule = device.granularity();
    let range = ok(device.reserve(4 * granule), "reserve");
    let mut bytes = vec![0u8; granule];
    let first = ok(range.slice(0, granule), "slice");
    assert!(matches!(
        device.read(first, &mut bytes),
        Err(DeviceError::BadRange { .. })
    ));
    let mut host = ok(device.alloc_host(granule), "alloc_host");
    assert!(device.copy_to_host(first, &mut host, 0).is_err());
    ok(device.commit(first), "commit");
    ok(
        device.read(first, &mut bytes),
        "read of a committed granule",
    );
    let straddling = ok(range.slice(granule / 2, granule), "slice");
    assert!(device.read(straddling, &mut bytes).is_err());
    ok(device.release(first), "release");
    assert!(device.copy_from_host(&mut host, 0, first).is_err());
    assert!(device.release(first).is_err(), "a second release must fail");
    ok(device.unreserve(range), "unreserve");
}

#[test]
fn cuda_one_range_goes_out_while_another_comes_in() {
    let Some((_gpu, device)) = gpu("cuda_one_range_goes_out_while_another_comes_in") else {
        return;
    };
    let len = GIB + 3 * device.granularity();
    let (outgoing, incoming) = (random_bytes(len, 41), random_bytes(len, 42));
    let a = committed(&device, len);
    let b = committed(&device, len);
    ok(device.write(&outgoing, a), "write a");
    let mut out = ok(device.alloc_host(len), "alloc_host");
    let mut into = ok(device.alloc_host(len), "alloc_host");
    ok(into.as_mut_slice(), "host bytes").copy_from_slice(&incoming);
    std::thread::scope(|scope| {
        let going = scope.spawn(|| device.copy_to_host(a, &mut out, 0));
        let coming = scope.spawn(|| device.copy_from_host(&mut into, 0, b));
        for handle in [going, coming] {
            let fence = handle
                .join()
                .unwrap_or_else(|_| panic!("copy thread panicked"));
            ok(ok(fence, "copy").wait(), "wait");
        }
    });
    let worst = first_difference(ok(out.as_slice(), "out"), &outgoing);
    assert!(
        worst.is_none(),
        "copy out differs at byte {worst:?} (tolerance: none)"
    );
    let mut back = vec![0u8; len];
    ok(device.read(b, &mut back), "read b");
    let worst = first_difference(&back, &incoming);
    assert!(
        worst.is_none(),
        "copy in differs at byte {worst:?} (tolerance: none)"
    );
}

#[test]
fn cuda_release_waits_for_a_copy_still_reading_the_range() {
    let Some((_gpu, device)) = gpu("cuda_release_waits_for_a_copy_still_reading_the_range") else {
        return;
    };
    let len = 2 * GIB;
    let data = random_bytes(len, 77);
    let range = committed(&device, len);
    ok(device.write(&data, range), "write");
    let mut backup = ok(device.alloc_host(len), "alloc_host");
    let fence = ok(device.copy_to_host(range, &mut backup, 0), "copy out");
    ok(
        device.release(range),
        "release right after queuing the copy",
    );
    assert!(
        ok(fence.is_done(), "fence"),
        "release returned before the copy finished"
    );
    let worst = first_difference(ok(backup.as_slice(), "backup"), &data);
    assert!(
        worst.is_none(),
        "backup differs at byte {worst:?} (tolerance: none)"
    );
}

#[test]
fn cuda_releasing_part_of_a_commit_keeps_the_rest_intact() {
    let Some((_gpu, device)) = gpu("cuda_releasing_part_of_a_commit_keeps_the_rest_intact") else {
        return;
    };
    let granule = device.granularity();
    // Large enough (1 GiB) that the device-to-device copy keeping the tail outlasts the driver
    // calls after it: a split that unmapped before the copy finished faulted here.
    let len = 512 * granule;
    let data = random_bytes(len, 99);
    let range = committed(&device, len);
    ok(device.write(&data, range), "write");
    let middle = ok(range.slice(3 * granule, 2 * granule), "slice");
    ok(device.release(middle), "release the middle");
    let mut byte = [0u8; 1];
    assert!(
        device
            .read(ok(middle.slice(0, 1), "slice"), &mut byte)
            .is_err()
    );
    for (offset, part_len) in [(0, 3 * granule), (5 * granule, len - 5 * granule)] {
        let mut back = vec![0u8; part_len];
        ok(
            device.read(ok(range.slice(offset, part_len), "slice"), &mut back),
            "read",
        );
        let worst = first_difference(&back, &data[offset..offset + part_len]);
        assert!(
            worst.is_none(),
            "kept part at {offset} differs at {worst:?} (tolerance: none)"
        );
    }
    ok(device.commit(middle), "commit the middle again");
    ok(device.unreserve(range), "unreserve");
}

#[test]
fn cuda_a_copy_in_then_out_of_the_same_range_is_ordered_without_waiting() {
    let Some((_gpu, device)) = gpu("cuda_a_copy_in_then_out_of_the_same_range_is_ordered") else {
        return;
    };
    let len = 256 * MIB;
    let data = random_bytes(len, 123);
    let range = committed(&device, len);
    let mut source = ok(device.alloc_host(len), "alloc_host");
    ok(source.as_mut_slice(), "host bytes").copy_from_slice(&data);
    let mut sink = ok(device.alloc_host(len), "alloc_host");
    let _in = ok(device.copy_from_host(&mut source, 0, range), "copy in");
    ok(
        ok(device.copy_to_host(range, &mut sink, 0), "copy out").wait(),
        "wait",
    );
    let worst = first_difference(ok(sink.as_slice(), "sink"), &data);
    assert!(
        worst.is_none(),
        "out-after-in differs at byte {worst:?} (tolerance: none)"
    );
}

#[test]
fn cuda_registered_host_memory_and_many_pieces_round_trip() {
    let Some((_gpu, _default)) = gpu("cuda_registered_host_memory_and_many_pieces_round_trip")
    else {
        return;
    };
    let options = CudaOptions {
        commit_chunk: 64 * MIB,
        pin_threads: 4,
        ..CudaOptions::default()
    };
    let device = ok(CudaDevice::open_with(0, options), "open_with");
    let len = 640 * MIB + 5;
    let data = random_bytes(len, 2024);
    let range = committed(&device, len);
    let bytes = ok(range.slice(0, len), "slice");
    let mut host = ok(device.alloc_host(len), "alloc_host");
    ok(host.as_mut_slice(), "host bytes").copy_from_slice(&data);
    ok(
        ok(device.copy_from_host(&mut host, 0, bytes), "copy in").wait(),
        "wait in",
    );
    let mut backup = ok(device.alloc_host(len), "alloc_host");
    ok(
        ok(device.copy_to_host(bytes, &mut backup, 0), "copy out").wait(),
        "wait out",
    );
    let before = ok(device.memory_info(), "memory_info").free;
    ok(device.release(range), "release of eleven pieces");
    let freed = ok(device.memory_info(), "memory_info")
        .free
        .saturating_sub(before);
    assert!(
        freed as f64 >= 0.995 * range.len as f64,
        "freed {freed} of {}",
        range.len
    );
    ok(device.commit(range), "commit again");
    ok(
        ok(device.copy_from_host(&mut backup, 0, bytes), "copy back").wait(),
        "wait back",
    );
    let mut back = vec![0u8; len];
    ok(device.read(bytes, &mut back), "read");
    let worst = first_difference(&back, &data);
    assert!(
        worst.is_none(),
        "first difference at byte {worst:?} (tolerance: none)"
    );
}

#[test]
fn cuda_a_compute_stream_waits_on_a_resume_fence_without_a_host_wait() {
    let Some((_gpu, device)) = gpu("cuda_a_compute_stream_waits_on_a_resume_fence") else {
        return;
    };
    let len = GIB;
    let range = committed(&device, len);
    let mut source = ok(device.alloc_host(len), "alloc_host");
    ok(source.as_mut_slice(), "host bytes").copy_from_slice(&random_bytes(len, 11));
    let context = cudarc::driver::CudaContext::new(0)
        .unwrap_or_else(|error| panic!("cudarc context: {error}"));
    let stream = context
        .new_stream()
        .unwrap_or_else(|error| panic!("cudarc stream: {error}"));
    // A 1 GiB copy takes about 20 ms at the link's speed: a stream that does not wait for it
    // reaches its own fence long before the copy is done.
    let resume = ok(device.copy_from_host(&mut source, 0, range), "copy in");
    ok(device.stream_wait(&stream, &resume), "stream_wait");
    let after = ok(device.record_fence(&stream), "record_fence");
    ok(after.wait(), "wait for the compute stream");
    assert!(
        ok(resume.is_done(), "query the copy"),
        "the compute stream ran past a copy it was told to wait for"
    );
    ok(
        device.stream_wait(&stream, &Fence::signalled()),
        "signalled",
    );
}

#[test]
fn cuda_release_splits_frees_and_recommits_bit_exact() {
    let Some((_gpu, _default)) = gpu("cuda_release_splits_frees_and_recommits_bit_exact") else {
        return;
    };
    let len = 640 * MIB;
    let data = random_bytes(len, 4242);
    let options = CudaOptions {
        commit_chunk: 64 * MIB,
        ..CudaOptions::default()
    };
    let device = ok(CudaDevice::open_with(0, options), "open_with");
    let range = ok(device.reserve(len), "reserve");
    // Two commits, so that a release spans mappings of both.
    for half in [0, len / 2] {
        ok(
            device.commit(ok(range.slice(half, len / 2), "slice")),
            "commit",
        );
    }
    ok(device.write(&data, range), "write");
    // Cuts the mappings at 64..128 and 320..384 MiB, and frees three whole ones between.
    let middle = ok(range.slice(100 * MIB, 256 * MIB), "slice");
    ok(device.release(middle), "release the middle");
    for (offset, part_len) in [(0, 100 * MIB), (356 * MIB, len - 356 * MIB)] {
        let mut back = vec![0u8; part_len];
        ok(
            device.read(ok(range.slice(offset, part_len), "slice"), &mut back),
            "read",
        );
        let worst = first_difference(&back, &data[offset..offset + part_len]);
        assert!(
            worst.is_none(),
            "kept part at {offset} differs at {worst:?} (tolerance: none)"
        );
    }
    ok(device.commit(middle), "commit the middle again");
    let before = ok(device.memory_info(), "memory_info").free;
    ok(device.release(range), "release all");
    let freed = ok(device.memory_info(), "memory_info")
        .free
        .saturating_sub(before);
    assert!(
        freed as f64 >= 0.995 * len as f64,
        "freed {freed} of {len} bytes"
    );
    ok(device.commit(range), "commit again");
    ok(device.write(&data, range), "write again");
    let mut back = vec![0u8; len];
    ok(device.read(range, &mut back), "read again");
    let worst = first_difference(&back, &data);
    assert!(
        worst.is_none(),
        "round trip differs at {worst:?} (tolerance: none)"
    );
    ok(device.unreserve(range), "unreserve");
}
