//! The CUDA device's book of reserved ranges and of the physical mappings inside them.
//!
//! Pure bookkeeping, no driver calls: the device asks it which mappings a release touches and
//! whether a copy's range is committed, and tells it what it mapped and unmapped.

use std::collections::BTreeMap;

use crate::device::{AddressRange, DeviceAddress, DeviceError};

/// One physical allocation (a `cuMemCreate` piece) mapped whole at a start address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    /// First address it is mapped at.
    pub(crate) start: DeviceAddress,
    /// Length in bytes, the handle's size.
    pub(crate) len: usize,
    /// The physical memory handle (`cuMemCreate`), released when the mapping is unmapped.
    pub(crate) handle: u64,
}

impl Mapping {
    /// The addresses it covers.
    pub(crate) fn range(&self) -> AddressRange {
        AddressRange {
            start: self.start,
            len: self.len,
        }
    }
}

#[derive(Debug)]
struct Reservation {
    len: usize,
    mappings: BTreeMap<DeviceAddress, Mapping>,
}

/// Reserved ranges by start address, each with its mappings by start address.
#[derive(Debug, Default)]
pub(crate) struct Reservations {
    by_start: BTreeMap<DeviceAddress, Reservation>,
}

fn bad(range: AddressRange, expected: &'static str) -> DeviceError {
    DeviceError::BadRange {
        start: range.start,
        len: range.len,
        expected,
    }
}

impl Reservations {
    /// Record a new reservation.
    pub(crate) fn insert(&mut self, range: AddressRange) {
        self.by_start.insert(
            range.start,
            Reservation {
                len: range.len,
                mappings: BTreeMap::new(),
            },
        );
    }

    /// Forget the reservation that is exactly `range`, which must have no mappings left.
    pub(crate) fn remove(&mut self, range: AddressRange) -> Result<(), DeviceError> {
        match self.by_start.get(&range.start) {
            Some(reservation)
                if reservation.len == range.len && reservation.mappings.is_empty() =>
            {
                self.by_start.remove(&range.start);
                Ok(())
            }
            _ => Err(bad(range, "reserved")),
        }
    }

    /// Whether `range` is exactly one reservation.
    pub(crate) fn is_reservation(&self, range: AddressRange) -> bool {
        self.by_start
            .get(&range.start)
            .is_some_and(|reservation| reservation.len == range.len)
    }

    fn containing(&self, range: AddressRange) -> Option<&Reservation> {
        let (start, reservation) = self.by_start.range(..=range.start).next_back()?;
        (range.end() <= start + reservation.len as u64).then_some(reservation)
    }

    fn containing_mut(&mut self, range: AddressRange) -> Option<&mut Reservation> {
        let (start, reservation) = self.by_start.range_mut(..=range.start).next_back()?;
        (range.end() <= start + reservation.len as u64).then_some(reservation)
    }

    /// The mappings that overlap `range`, in address order; empty when `range` lies in no
    /// reservation.
    pub(crate) fn overlapping(&self, range: AddressRange) -> Vec<Mapping> {
        let Some(reservation) = self.containing(range) else {
            return Vec::new();
        };
        let first = reservation
            .mappings
            .range(..=range.start)
            .next_back()
            .map_or(range.start, |(start, _)| *start);
        reservation
            .mappings
            .range(first..range.end())
            .map(|(_, mapping)| *mapping)
            .filter(|mapping| mapping.range().end() > range.start)
            .collect()
    }

    /// Whether every byte of `range` (non-empty) is mapped.
    pub(crate) fn is_committed(&self, range: AddressRange) -> bool {
        let mut covered_to = range.start;
        for mapping in self.overlapping(range) {
            if mapping.start > covered_to {
                return false;
            }
            covered_to = covered_to.max(mapping.range().end());
        }
        covered_to >= range.end() && range.len > 0
    }

    /// Check that `range` lies in one reservation and no byte of it is mapped.
    pub(crate) fn check_uncommitted(&self, range: AddressRange) -> Result<(), DeviceError> {
        if self.containing(range).is_none() {
            return Err(bad(range, "reserved"));
        }
        if !self.overlapping(range).is_empty() {
            return Err(bad(range, "released"));
        }
        Ok(())
    }

    /// Check that every byte of `range` is mapped.
    pub(crate) fn check_committed(&self, range: AddressRange) -> Result<(), DeviceError> {
        if self.is_committed(range) {
            Ok(())
        } else {
            Err(bad(range, "committed"))
        }
    }

    /// Record a new mapping inside a reservation.
    pub(crate) fn add(&mut self, mapping: Mapping) -> Result<(), DeviceError> {
        let reservation = self
            .containing_mut(mapping.range())
            .ok_or_else(|| bad(mapping.range(), "reserved"))?;
        reservation.mappings.insert(mapping.start, mapping);
        Ok(())
    }

    /// Forget the mapping that starts at `start`.
    pub(crate) fn forget(&mut self, mapping: Mapping) {
        if let Some(reservation) = self.containing_mut(mapping.range()) {
            reservation.mappings.remove(&mapping.start);
        }
    }

    /// Bytes mapped over every reservation.
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.by_start
            .values()
            .flat_map(|reservation| reservation.mappings.values())
            .map(|mapping| mapping.len as u64)
            .sum()
    }

    /// Every reserved range.
    pub(crate) fn reserved(&self) -> Vec<AddressRange> {
        self.by_start
            .iter()
            .map(|(start, reservation)| AddressRange {
                start: *start,
                len: reservation.len,
            })
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::panic)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn range(start: u64, len: usize) -> AddressRange {
        AddressRange { start, len }
    }

    fn book() -> Reservations {
        let mut book = Reservations::default();
        book.insert(range(0x1000_0000, 64 * MIB));
        book
    }

    fn map(book: &mut Reservations, start: u64, len: usize, handle: u64) {
        book.add(Mapping { start, len, handle })
            .unwrap_or_else(|error| panic!("mapping inside the reservation: {error}"));
    }

    #[test]
    fn committed_needs_every_byte_mapped() {
        let mut book = book();
        let base = 0x1000_0000;
        map(&mut book, base, 4 * MIB, 1);
        map(&mut book, base + (6 * MIB) as u64, 2 * MIB, 2);
        assert!(book.is_committed(range(base, 4 * MIB)));
        assert!(book.is_committed(range(base + 1, 1)));
        assert!(!book.is_committed(range(base, 6 * MIB)));
        assert!(!book.is_committed(range(base + (3 * MIB) as u64, 4 * MIB)));
        assert!(book.is_committed(range(base + (6 * MIB) as u64, 2 * MIB)));
        map(&mut book, base + (4 * MIB) as u64, 2 * MIB, 3);
        assert!(book.is_committed(range(base + MIB as u64, 7 * MIB)));
    }

    #[test]
    fn overlapping_finds_a_mapping_that_starts_before_the_range() {
        let mut book = book();
        let base = 0x1000_0000;
        map(&mut book, base, 8 * MIB, 7);
        map(&mut book, base + (8 * MIB) as u64, 8 * MIB, 8);
        let found = book.overlapping(range(base + (6 * MIB) as u64, 4 * MIB));
        let handles: Vec<u64> = found.iter().map(|mapping| mapping.handle).collect();
        assert_eq!(handles, vec![7, 8]);
        assert!(
            book.overlapping(range(base + (16 * MIB) as u64, MIB))
                .is_empty()
        );
    }

    #[test]
    fn uncommitted_check_refuses_overlap_and_foreign_ranges() {
        let mut book = book();
        let base = 0x1000_0000;
        map(&mut book, base + (2 * MIB) as u64, 2 * MIB, 1);
        assert!(book.check_uncommitted(range(base, 2 * MIB)).is_ok());
        assert!(book.check_uncommitted(range(base, 4 * MIB)).is_err());
        assert!(
            book.check_uncommitted(range(base + (63 * MIB) as u64, 2 * MIB))
                .is_err()
        );
        assert!(book.check_uncommitted(range(0x10, 2 * MIB)).is_err());
    }

    #[test]
    fn a_range_whose_end_overflows_lies_in_no_reservation() {
        let mut book = book();
        let base = 0x1000_0000;
        map(&mut book, base, 2 * MIB, 1);
        let huge = range(base, usize::MAX);
        assert!(!book.is_committed(huge));
        assert!(book.check_uncommitted(huge).is_err());
        assert!(book.overlapping(huge).is_empty());
    }

    #[test]
    fn a_reservation_with_mappings_cannot_be_removed() {
        let mut book = book();
        let base = 0x1000_0000;
        map(&mut book, base, 2 * MIB, 1);
        assert!(book.remove(range(base, 64 * MIB)).is_err());
        book.forget(Mapping {
            start: base,
            len: 2 * MIB,
            handle: 1,
        });
        assert!(book.remove(range(base, 32 * MIB)).is_err());
        assert!(book.remove(range(base, 64 * MIB)).is_ok());
        assert!(book.reserved().is_empty());
    }
}
