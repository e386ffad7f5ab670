//! The disk backup's faults: a write that fails, a full disk, a flipped byte, a failed resume
//! whose files must outlive the manager.

use super::*;

#[test]
fn an_injected_write_fault_keeps_the_tag_active_and_removes_partial_files() {
    let dir = tempfile::tempdir().unwrap();
    let (_, mut memory) = manager(64 * MIB, Some(dir.path()));
    memory.inject_disk_write_fault(2);
    let tag = MemoryTag::Optimizer;
    memory
        .create_region(tag.clone(), BackupPolicy::Disk, 16 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 6 * MIB + 3).unwrap();
    let data = random_bytes(13, 6 * MIB + 3);
    buffer.write(0, &data).unwrap();
    let error = memory.pause(&tag).unwrap_err();
    assert!(
        matches!(&error, MemoryError::Store { source: StoreError::Io { action, .. }, .. } if action.contains("chunk 2")),
        "{error}"
    );
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Active);
    assert_eq!(first_difference(&contents(&buffer), &data), None);
    let tag_dir = dir.path().join("offload/rank-0").join("optimizer");
    assert_eq!(
        std::fs::read_dir(tag_dir).unwrap().count(),
        0,
        "partial files left"
    );
}

#[test]
fn a_full_disk_keeps_the_tag_active_and_intact() {
    let dir = tempfile::tempdir().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs"])
        .arg(dir.path())
        .status()
        .is_ok_and(|status| status.success());
    if !mounted {
        eprintln!("skipped: cannot mount a small tmpfs (needs root)");
        return;
    }
    let outcome = std::panic::catch_unwind(|| {
        let (_, memory) = manager(64 * MIB, Some(dir.path()));
        let tag = MemoryTag::Params;
        memory
            .create_region(tag.clone(), BackupPolicy::Disk, 16 * MIB)
            .unwrap();
        let mut buffer = memory.alloc(&tag, 8 * MIB).unwrap();
        let data = random_bytes(17, 8 * MIB);
        buffer.write(0, &data).unwrap();
        let error = memory.pause(&tag).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("data.bin"), "{message}");
        assert!(
            matches!(&error, MemoryError::Store { source: StoreError::Io { source, .. }, .. } if source.raw_os_error() == Some(libc::ENOSPC)),
            "{message}"
        );
        assert_eq!(memory.state(&tag).unwrap(), RegionState::Active);
        assert_eq!(first_difference(&contents(&buffer), &data), None);
        let tag_dir = dir.path().join("offload/rank-0").join("params");
        assert_eq!(
            std::fs::read_dir(tag_dir).unwrap().count(),
            0,
            "partial files left"
        );
    });
    let _ = std::process::Command::new("umount")
        .arg(dir.path())
        .status();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn a_flipped_byte_fails_resume_naming_file_and_chunk_and_keeps_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let (_, memory) = manager(64 * MIB, Some(dir.path()));
    let tag = MemoryTag::Weights;
    memory
        .create_region(tag.clone(), BackupPolicy::Disk, 16 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 3 * MIB).unwrap();
    let data = random_bytes(19, 3 * MIB);
    buffer.write(0, &data).unwrap();
    memory.pause(&tag).unwrap();
    let file = dir
        .path()
        .join("offload/rank-0")
        .join("weights")
        .join("data.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = MIB + 12345;
    bytes[at] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let error = memory.resume(&tag).unwrap_err();
    assert!(
        matches!(&error, MemoryError::Store { source: StoreError::ChecksumMismatch { chunk: 1, path, .. }, .. } if *path == file),
        "{error}"
    );
    assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
    assert!(file.exists());
    bytes[at] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    memory.resume(&tag).unwrap();
    assert_eq!(first_difference(&contents(&buffer), &data), None);
    assert!(!file.exists(), "files must go after a verified resume");
}

#[test]
fn a_failed_disk_resume_keeps_its_files_after_the_manager_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (_, memory) = manager(64 * MIB, Some(dir.path()));
    let tag = MemoryTag::Params;
    memory
        .create_region(tag.clone(), BackupPolicy::Disk, 4 * MIB)
        .unwrap();
    let mut buffer = memory.alloc(&tag, 2 * MIB).unwrap();
    buffer.write(0, &random_bytes(29, 2 * MIB)).unwrap();
    memory.pause(&tag).unwrap();
    let tag_dir = dir.path().join("offload/rank-0/params");
    let file = tag_dir.join("data.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[7] ^= 0x01;
    std::fs::write(&file, &bytes).unwrap();
    let error = memory.resume(&tag).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("files are kept"), "{message}");
    drop(buffer);
    drop(memory);
    assert!(
        file.exists(),
        "the files of a failed resume are kept at exit"
    );
    assert!(tag_dir.join("manifest.json").exists());
    drop(manager(64 * MIB, Some(dir.path())));
    assert!(
        !tag_dir.exists(),
        "the next manager on the directory removes them"
    );
}
