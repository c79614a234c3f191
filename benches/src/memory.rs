//! A global allocator that counts the bytes the process holds, and the most it has held since
//! the last reset, for memory figures of CPU runs (burn's CPU backends allocate tensors on the
//! heap, on the thread that computes them). A bench installs it with
//! `#[global_allocator] static ALLOC: CountingAllocator = CountingAllocator;`.
//!
//! Threads that run ranks can name themselves with [`set_slot`]: every allocation is then
//! charged to the slot of the thread that made it until it is freed, by whichever thread frees
//! it (a tensor sent to another rank stays charged to its sender). The slot is kept in a
//! small header before each allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots a bench can charge (slot 0 is every thread that did not name one).
pub const SLOTS: usize = 64;

static LIVE: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static PEAK: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static TOTAL_LIVE: AtomicUsize = AtomicUsize::new(0);
static TOTAL_PEAK: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting live bytes per slot and in all.
pub struct CountingAllocator;

/// Header bytes before an allocation: room for the slot, keeping the caller's alignment.
fn header(layout: Layout) -> usize {
    layout.align().max(size_of::<usize>())
}

/// The layout actually asked of the system allocator.
fn padded(layout: Layout, size: usize) -> Option<Layout> {
    let pad = header(layout);
    Layout::from_size_align(size.checked_add(pad)?, pad).ok()
}

fn grow(slot: usize, bytes: usize) {
    let live = LIVE[slot].fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK[slot].fetch_max(live, Ordering::Relaxed);
    let total = TOTAL_LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    TOTAL_PEAK.fetch_max(total, Ordering::Relaxed);
}

fn shrink(slot: usize, bytes: usize) {
    LIVE[slot].fetch_sub(bytes, Ordering::Relaxed);
    TOTAL_LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

/// Writes the slot into the header of the block at `base` and returns the caller's pointer.
///
/// # Safety
/// `base` is a live block of at least `header(layout)` bytes, aligned to it.
unsafe fn tag(base: *mut u8, layout: Layout) -> *mut u8 {
    let slot = SLOT.try_with(Cell::get).unwrap_or(0);
    let pad = header(layout);
    // SAFETY: the header lies inside the block and is aligned to usize (pad is a multiple).
    unsafe {
        let user = base.add(pad);
        user.sub(size_of::<usize>()).cast::<usize>().write(slot);
        grow(slot, layout.size());
        user
    }
}

/// The slot charged for the block whose caller's pointer is `ptr`.
///
/// # Safety
/// `ptr` came from [`tag`].
unsafe fn owner(ptr: *mut u8) -> usize {
    // SAFETY: `tag` wrote the slot just before `ptr`.
    unsafe { ptr.sub(size_of::<usize>()).cast::<usize>().read() }
}

// SAFETY: every block is the system's, asked with a padded layout that keeps the caller's
// alignment; the caller gets the part after the header, and the same padding is undone before
// the block goes back to the system.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(full) = padded(layout, layout.size()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `full` has a non-zero size.
        let base = unsafe { System.alloc(full) };
        if base.is_null() {
            return base;
        }
        // SAFETY: `base` is a fresh block of `full`.
        unsafe { tag(base, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let Some(full) = padded(layout, layout.size()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `full` has a non-zero size.
        let base = unsafe { System.alloc_zeroed(full) };
        if base.is_null() {
            return base;
        }
        // SAFETY: `base` is a fresh block of `full`.
        unsafe { tag(base, layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let full = padded(layout, layout.size()).expect("it was allocated with this layout");
        // SAFETY: `ptr` came from `alloc` with `layout`: its block starts `header` bytes before.
        unsafe {
            shrink(owner(ptr), layout.size());
            System.dealloc(ptr.sub(header(layout)), full);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let full = padded(layout, layout.size()).expect("it was allocated with this layout");
        let Some(new_full) = padded(layout, new_size) else {
            return std::ptr::null_mut();
        };
        let pad = header(layout);
        // SAFETY: `ptr` came from `alloc` with `layout`; the system moves the header with the
        // block, so the slot stays the one first charged.
        unsafe {
            let slot = owner(ptr);
            let base = System.realloc(ptr.sub(pad), full, new_full.size());
            if base.is_null() {
                return base;
            }
            shrink(slot, layout.size());
            grow(slot, new_size);
            base.add(pad)
        }
    }
}

/// Charges this thread's later allocations to `slot` (1 to `SLOTS - 1`; 0 is the default).
pub fn set_slot(slot: usize) {
    assert!(slot < SLOTS, "a memory slot is below {SLOTS}");
    SLOT.with(|s| s.set(slot));
}

/// Bytes the process holds now (0 unless [`CountingAllocator`] is the global allocator).
pub fn live_bytes() -> usize {
    TOTAL_LIVE.load(Ordering::Relaxed)
}

/// The most bytes the process held at once since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    TOTAL_PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak of the whole process from what it holds now.
pub fn reset_peak() {
    TOTAL_PEAK.store(live_bytes(), Ordering::Relaxed);
}

/// Bytes charged to `slot` now.
pub fn slot_live_bytes(slot: usize) -> usize {
    LIVE[slot].load(Ordering::Relaxed)
}

/// The most bytes charged to `slot` at once since the last [`reset_slot_peak`] of it.
pub fn slot_peak_bytes(slot: usize) -> usize {
    PEAK[slot].load(Ordering::Relaxed)
}

/// Starts a new peak of `slot` from what it holds now.
pub fn reset_slot_peak(slot: usize) {
    PEAK[slot].store(slot_live_bytes(slot), Ordering::Relaxed);
}
