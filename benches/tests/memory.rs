//! The counting allocator charges each allocation to the slot of the thread that made it, until
//! it is freed by any thread.

use benches::memory::{
    CountingAllocator, reset_slot_peak, set_slot, slot_live_bytes, slot_peak_bytes,
};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const MB: usize = 1 << 20;

#[test]
fn an_allocation_stays_charged_to_its_maker_until_freed_anywhere() {
    let (maker, freer) = (7, 8);
    let made = std::thread::spawn(move || {
        set_slot(maker);
        reset_slot_peak(maker);
        let mut bytes = vec![1u8; MB];
        bytes.reserve_exact(MB); // a realloc keeps the charge on the maker
        assert!(slot_live_bytes(maker) >= 2 * MB);
        bytes
    })
    .join()
    .unwrap();
    let before = slot_live_bytes(maker);
    std::thread::spawn(move || {
        set_slot(freer);
        let freer_before = slot_live_bytes(freer);
        drop(made);
        assert_eq!(slot_live_bytes(freer), freer_before);
    })
    .join()
    .unwrap();
    assert!(before - slot_live_bytes(maker) >= 2 * MB);
    assert!(slot_peak_bytes(maker) >= 2 * MB);
    // An aligned allocation round-trips through the header.
    let aligned = std::alloc::Layout::from_size_align(100, 256).unwrap();
    // SAFETY: a non-zero layout, freed with the same layout.
    unsafe {
        let ptr = std::alloc::alloc(aligned);
        assert_eq!(ptr as usize % 256, 0);
        std::alloc::dealloc(ptr, aligned);
    }
}
