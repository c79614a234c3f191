//! The schedule builders against the papers: every schedule they make is valid, and with unit
//! costs its simulated bubble is the published formula; broken schedules are caught.

use burn_pipeline::{Action, Costs, Kind, Schedule, ScheduleKind, simulate};

fn kinds(ranks: usize, micro_batches: usize) -> Vec<(ScheduleKind, usize)> {
    let mut kinds = vec![
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::ZeroBubbleH1, 1),
    ];
    if micro_batches.is_multiple_of(ranks) {
        kinds.extend((2..=4).map(|v| (ScheduleKind::Interleaved, v)));
    }
    kinds
}

#[test]
fn every_built_schedule_is_valid_and_matches_its_formula() {
    for ranks in 1..=6 {
        for micro_batches in 1..=13 {
            for (kind, v) in kinds(ranks, micro_batches) {
                let what = format!("{kind} p {ranks} m {micro_batches} v {v}");
                let schedule = Schedule::new(kind, ranks, micro_batches, v).unwrap();
                schedule
                    .validate()
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let timeline = simulate(&schedule, &Costs::UNIT).unwrap();
                let formula = schedule.bubble_formula(&Costs::UNIT);
                // ZB-H1's formula assumes enough micro-batches to fill its warm-up.
                if kind != ScheduleKind::ZeroBubbleH1 || micro_batches >= ranks {
                    assert!(
                        (timeline.bubble() - formula).abs() < 1e-9,
                        "{what}: simulated {} formula {formula}",
                        timeline.bubble()
                    );
                }
            }
        }
    }
}

#[test]
fn interleaving_and_zero_bubble_cut_the_bubble() {
    let bubble = |kind, v| {
        let schedule = Schedule::new(kind, 4, 8, v).unwrap();
        simulate(&schedule, &Costs::UNIT).unwrap().bubble()
    };
    let one_f_one_b = bubble(ScheduleKind::OneFOneB, 1);
    assert!((one_f_one_b - 3.0 / 11.0).abs() < 1e-12);
    // Interleaving divides the bubble's time by v: (p-1)/(v m + p-1).
    assert!((bubble(ScheduleKind::Interleaved, 2) - 3.0 / 19.0).abs() < 1e-12);
    assert!((bubble(ScheduleKind::Interleaved, 4) - 3.0 / 35.0).abs() < 1e-12);
    // ZB-H1: a third of 1F1B's idle time, (p-1)/(3m+p-1).
    assert!((bubble(ScheduleKind::ZeroBubbleH1, 1) - 3.0 / 27.0).abs() < 1e-12);
}

#[test]
fn activations_in_flight_are_the_papers() {
    let peaks = |kind, v| {
        let schedule = Schedule::new(kind, 4, 8, v).unwrap();
        simulate(&schedule, &Costs::UNIT)
            .unwrap()
            .peak_activations()
    };
    // GPipe holds every micro-batch; 1F1B at most p - r; ZB-H1 the same as 1F1B.
    assert_eq!(peaks(ScheduleKind::Gpipe, 1), vec![8.0; 4]);
    assert_eq!(peaks(ScheduleKind::OneFOneB, 1), vec![4.0, 3.0, 2.0, 1.0]);
    assert_eq!(
        peaks(ScheduleKind::ZeroBubbleH1, 1),
        vec![4.0, 3.0, 2.0, 1.0]
    );
    // Interleaving holds a little more on each rank: (1 + (p-1)/(p v)) times 1F1B's first.
    let interleaved = peaks(ScheduleKind::Interleaved, 2);
    assert_eq!(interleaved[0], 5.5);
    assert!(interleaved.windows(2).all(|w| w[0] > w[1]));
}

#[test]
fn one_f_one_b_reads_as_in_the_paper() {
    let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    assert_eq!(
        schedule.describe(0),
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    );
    assert_eq!(
        schedule.describe(3),
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    );
    // Rank 1 receives its input before the forward and sends its output right after.
    let first: Vec<Kind> = schedule.actions[1][..3].iter().map(|a| a.kind).collect();
    assert_eq!(
        first,
        vec![Kind::RecvForward, Kind::Forward, Kind::SendForward]
    );
}

fn error_of(schedule: &Schedule) -> String {
    schedule.validate().unwrap_err().to_string()
}

#[test]
fn validate_names_the_first_violation() {
    let good = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();

    let mut missing = good.clone();
    let at = missing.actions[1]
        .iter()
        .position(|a| a.kind == Kind::Backward && a.micro_batch == 2)
        .unwrap();
    missing.actions[1].remove(at);
    let error = error_of(&missing);
    assert!(error.contains("micro-batch 2 at stage 1"), "{error}");
    assert!(error.contains("0 backward(s)"), "{error}");

    let mut wrong_rank = good.clone();
    wrong_rank.actions[0].push(Action {
        kind: Kind::Forward,
        micro_batch: 0,
        stage: 1,
    });
    let error = error_of(&wrong_rank);
    assert!(error.contains("lives on rank 1"), "{error}");

    // Rank 1 waits for the gradient of micro-batch 0 before sending any activation back...
    // rank 0 runs every backward before any forward it owes rank 1: a deadlock.
    let mut deadlock = good.clone();
    deadlock.actions[0].sort_by_key(|a| matches!(a.kind, Kind::Forward | Kind::SendForward) as u8);
    let error = error_of(&deadlock);
    assert!(error.contains("deadlock"), "{error}");
    assert!(
        error.contains(
            "rank 0 waits at the receive of the output gradient of micro-batch 0 at stage 0"
        ),
        "{error}"
    );

    // A hand-made schedule claiming more micro-batches than its actions could run is refused
    // before anything is sized by its claim.
    let mut claimed = good.clone();
    claimed.micro_batches = usize::MAX / 2;
    let error = error_of(&claimed);
    assert!(error.contains("cannot run the forward of"), "{error}");
    claimed.virtual_stages = usize::MAX;
    let error = error_of(&claimed);
    assert!(error.contains("cannot run the forward of"), "{error}");

    let mut unmatched = good;
    unmatched.actions[0].retain(|a| !(a.kind == Kind::SendForward && a.micro_batch == 3));
    let error = error_of(&unmatched);
    assert!(
        error.contains("send of the output of micro-batch 3"),
        "{error}"
    );
}

#[test]
fn impossible_layouts_are_refused_with_what_to_change() {
    let error = |kind, p, m, v| Schedule::new(kind, p, m, v).unwrap_err().to_string();
    let e = error(ScheduleKind::Interleaved, 4, 6, 2);
    assert!(e.contains("use a multiple of 4"), "{e}");
    let e = error(ScheduleKind::Interleaved, 4, 8, 1);
    assert!(e.contains("--virtual-stages 2 or more"), "{e}");
    let e = error(ScheduleKind::OneFOneB, 4, 8, 2);
    assert!(e.contains("--schedule interleaved"), "{e}");
    let e = error(ScheduleKind::Gpipe, 0, 8, 1);
    assert!(e.contains("at least one stage"), "{e}");
    let e = error(ScheduleKind::ZeroBubbleH1, 2, 0, 1);
    assert!(e.contains("one micro-batch"), "{e}");
}

#[test]
fn the_gantt_chart_has_a_box_per_forward_and_backward() {
    let schedule = Schedule::new(ScheduleKind::ZeroBubbleH1, 3, 4, 1).unwrap();
    let timeline = simulate(&schedule, &Costs::UNIT).unwrap();
    let svg = timeline.to_svg("zb-h1 <3 ranks>");
    let computes = schedule
        .actions
        .iter()
        .flatten()
        .filter(|a| a.kind.is_compute())
        .count();
    // One box per action, one background per rank, four legend swatches.
    assert_eq!(svg.matches("<rect").count(), computes + 3 + 4);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("zb-h1 &lt;3 ranks&gt;"));
    assert!(svg.contains(&format!("bubble {:.1}%", 100.0 * timeline.bubble())));
}
