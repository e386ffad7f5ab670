//! How the loop reads the trainer's device memory for its metrics and timeline.

use std::sync::Arc;

use crate::memory::{MemoryManager, MemoryTag};

/// Reads the device bytes a component's tags hold now.
///
/// The training backends keep their memory managers to themselves; the code that builds a
/// backend hands the loop a probe of its managers ([`ManagerProbe`]).
pub trait MemoryProbe: Send {
    /// Device bytes each tag holds now (nothing for a paused tag), summed over ranks.
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)>;
}

/// A probe of one or more memory managers (one per rank), summing each tag over them.
#[derive(Clone, Debug, Default)]
pub struct ManagerProbe {
    managers: Vec<Arc<MemoryManager>>,
}

impl ManagerProbe {
    /// A probe of `managers`.
    pub fn new(managers: Vec<Arc<MemoryManager>>) -> Self {
        Self { managers }
    }
}

impl MemoryProbe for ManagerProbe {
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        let mut tags: Vec<(MemoryTag, u64)> = Vec::new();
        for manager in &self.managers {
            for (tag, bytes) in manager.resident_bytes() {
                match tags.iter_mut().find(|(t, _)| *t == tag) {
                    Some((_, total)) => *total += bytes,
                    None => tags.push((tag, bytes)),
                }
            }
        }
        tags
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostDevice;
    use crate::memory::{BackupPolicy, ManagerSettings};

    #[test]
    fn probe_sums_tags_over_ranks_and_drops_paused_tags() {
        let manager = || {
            let m = MemoryManager::new(
                Arc::new(HostDevice::new(64 << 20)),
                ManagerSettings {
                    margin_bytes: 0,
                    disk: None,
                },
            )
            .unwrap();
            m.create_region(MemoryTag::Params, BackupPolicy::Host, 8 << 20)
                .unwrap();
            m.create_region(MemoryTag::Grads, BackupPolicy::None, 8 << 20)
                .unwrap();
            Arc::new(m)
        };
        let (a, b) = (manager(), manager());
        let _bufs: Vec<_> = [&a, &b]
            .iter()
            .flat_map(|m| {
                [
                    m.alloc(&MemoryTag::Params, 3 << 20).unwrap(),
                    m.alloc(&MemoryTag::Grads, 1 << 20).unwrap(),
                ]
            })
            .collect();
        let probe = ManagerProbe::new(vec![Arc::clone(&a), Arc::clone(&b)]);
        let get = |probe: &ManagerProbe, tag| {
            probe
                .resident_bytes()
                .into_iter()
                .find(|(t, _)| *t == tag)
                .map(|(_, b)| b)
        };
        let params = get(&probe, MemoryTag::Params).unwrap();
        assert!(params >= 6 << 20, "{params}");
        b.pause(&MemoryTag::Grads).unwrap();
        a.pause(&MemoryTag::Grads).unwrap();
        assert_eq!(get(&probe, MemoryTag::Grads), Some(0));
        assert_eq!(get(&probe, MemoryTag::Params), Some(params));
    }
}
