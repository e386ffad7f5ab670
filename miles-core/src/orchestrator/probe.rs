//! How the loop reads the trainer's device memory for its metrics and timeline.

use std::sync::Arc;

use crate::backend::OffloadStats;
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

/// A trainer's device memory as its own offload and onload reports tell it: the bytes of each
/// tag (summed over ranks) that the last move reported, on the device after an onload and
/// nothing after an offload. Known from the first move on; used where no probe of the
/// backend's memory managers is given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReportedMemory {
    tags: Vec<(MemoryTag, u64)>,
    on_device: bool,
}

impl ReportedMemory {
    /// Takes the tags and bytes of `stats`; `on_device` after an onload.
    pub fn record(&mut self, stats: &OffloadStats, on_device: bool) {
        let mut tags: Vec<(MemoryTag, u64)> = Vec::new();
        for report in stats.ranks.iter().flat_map(|r| &r.tags) {
            match tags.iter_mut().find(|(t, _)| *t == report.tag) {
                Some((_, total)) => *total += report.bytes,
                None => tags.push((report.tag.clone(), report.bytes)),
            }
        }
        self.tags = tags;
        self.on_device = on_device;
    }
}

impl MemoryProbe for ReportedMemory {
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        self.tags
            .iter()
            .map(|(tag, bytes)| (tag.clone(), if self.on_device { *bytes } else { 0 }))
            .collect()
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

    #[test]
    fn reported_memory_follows_the_last_move() {
        use crate::backend::RankOffload;
        use crate::config::OffloadTarget;
        let report = |tag: MemoryTag, bytes| crate::memory::OffloadReport {
            tag,
            bytes,
            seconds: 0.0,
            gbps: 0.0,
            free_before: 0,
            free_after: 0,
        };
        let stats = OffloadStats {
            target: OffloadTarget::Cpu,
            ranks: (0..2)
                .map(|rank| {
                    RankOffload::new(
                        rank,
                        0.0,
                        vec![report(MemoryTag::Params, 3), report(MemoryTag::Grads, 5)],
                    )
                })
                .collect(),
            seconds: 0.0,
        };
        let mut memory = ReportedMemory::default();
        assert!(memory.resident_bytes().is_empty());
        memory.record(&stats, false);
        assert_eq!(
            memory.resident_bytes(),
            [(MemoryTag::Params, 0), (MemoryTag::Grads, 0)]
        );
        memory.record(&stats, true);
        assert_eq!(
            memory.resident_bytes(),
            [(MemoryTag::Params, 6), (MemoryTag::Grads, 10)]
        );
    }
}
