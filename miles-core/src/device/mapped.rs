//! Read-only memory maps of checkpoint files, so a multi-gigabyte safetensors file is never read
//! whole: only the pages of the tensors asked for are faulted in.

use std::fs::File;
use std::path::Path;

/// A regular file mapped read-only.
#[derive(Debug)]
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Opens `path` (following symlinks, as Hugging Face's cache lays files out) and maps it,
    /// after checking that it is a regular file: a device such as `/dev/zero` or a FIFO is
    /// refused before any byte is read.
    ///
    /// # Errors
    /// What the system says about opening, inspecting or mapping the file; `InvalidInput` for a
    /// file that is not regular.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file; give a safetensors file",
            ));
        }
        // SAFETY: the map is read-only and private to this process; the safetensors files of a
        // checkpoint are not written while a job reads them (a file truncated underneath would
        // raise SIGBUS, as reading a truncated file with read(2) would fail).
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Self { map })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}
