use super::*;
use crate::comm::testing::{LocalJob, SECRET, local};

/// A raw connection to rank 0 on `port`, retrying while it does not listen yet.
fn raw(port: u16) -> TcpStream {
    let started = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(stream) => return stream,
            Err(_) if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(error) => panic!("rank 0 never listened: {error}"),
        }
    }
}

/// A handshake as rank `rank` of a world of `world` presenting `secret`.
fn hello(world: u32, rank: u32, secret: &[u8]) -> Vec<u8> {
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&world.to_le_bytes());
    bytes.extend_from_slice(&rank.to_le_bytes());
    bytes.extend_from_slice(&(secret.len() as u16).to_le_bytes());
    bytes.extend_from_slice(secret);
    bytes
}

/// A job of two on a fresh port: rank 0 starts, `intruder` runs against its port, then
/// rank 1 joins and both pass a barrier. What the intruder returned (kept alive until the
/// job formed) and how long the job took to form.
fn pair_after<T>(intruder: impl FnOnce(u16) -> T) -> (T, Duration) {
    let job = LocalJob::new();
    let started = Instant::now();
    let (env_0, env_1) = (job.rank(0, 2), job.rank(1, 2));
    let zero = std::thread::spawn(move || {
        let mut group = HostGroup::connect(&env_0, Duration::from_secs(20))?;
        group.barrier()
    });
    let kept = intruder(job.port());
    let one = std::thread::spawn(move || {
        let mut group = HostGroup::connect(&env_1, Duration::from_secs(20))?;
        group.barrier()
    });
    one.join().unwrap().unwrap();
    zero.join().unwrap().unwrap();
    (kept, started.elapsed())
}

/// Runs `body` on `world` threads, each with its rank's group; their results by rank.
fn on_ranks<T: Send + 'static>(
    world: usize,
    body: fn(&mut HostGroup) -> Result<T, CommError>,
) -> Vec<Result<T, CommError>> {
    let job = LocalJob::new();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let env = job.rank(rank, world);
            std::thread::spawn(move || {
                let mut group = HostGroup::connect(&env, Duration::from_secs(20))?;
                body(&mut group)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn gather_brings_every_part_to_rank_0_in_rank_order() {
    let results = on_ranks(4, |group| {
        group.barrier()?;
        let part = vec![group.rank() as u8; group.rank() * 3];
        let gathered = group.gather(&part)?;
        group.barrier()?;
        Ok(gathered)
    });
    let mut results = results.into_iter();
    let at_0 = results.next().unwrap().unwrap().unwrap();
    let want: Vec<Vec<u8>> = (0..4).map(|r| vec![r as u8; r * 3]).collect();
    assert_eq!(at_0, want);
    for other in results {
        assert_eq!(other.unwrap(), None);
    }
}

#[test]
fn broadcast_gives_every_rank_the_bytes_of_rank_0() {
    let results = on_ranks(3, |group| {
        let mut bytes = if group.rank() == 0 {
            b"rank zero".to_vec()
        } else {
            Vec::new()
        };
        group.broadcast(&mut bytes)?;
        Ok(bytes)
    });
    for result in results {
        assert_eq!(result.unwrap(), b"rank zero");
    }
}

#[test]
fn all_gather_gives_every_rank_every_part_in_rank_order() {
    let results = on_ranks(3, |group| {
        let part = vec![group.rank() as u8 + 1; [2, 0, 5][group.rank()]];
        let first = group.all_gather(&part)?;
        let second = group.all_gather(b"again")?;
        Ok((first, second))
    });
    let want: Vec<Vec<u8>> = vec![vec![1; 2], Vec::new(), vec![3; 5]];
    for result in results {
        let (first, second) = result.unwrap();
        assert_eq!(first, want);
        assert_eq!(second, vec![b"again".to_vec(); 3]);
    }
}

#[test]
fn an_all_gather_part_above_the_frame_limit_is_refused_before_it_is_sent() {
    let results = on_ranks(2, |group| {
        let part = vec![0u8; if group.rank() == 1 { MAX_SHARED + 1 } else { 1 }];
        group.all_gather(&part)
    });
    let error = results[1].as_ref().unwrap_err().to_string();
    assert!(error.contains("all-gather"), "{error}");
}

#[test]
fn route_gives_each_rank_the_part_of_the_rank_it_names() {
    let results = on_ranks(4, |group| {
        let part = vec![group.rank() as u8; 3];
        // Two groups of two, each rank taking its group's first rank's part.
        let first = group.route(&part, |rank| rank - rank % 2)?;
        let backwards = group.route(&part, |rank| 3 - rank)?;
        Ok((first, backwards))
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (first, backwards) = result.unwrap();
        assert_eq!(first, vec![(rank - rank % 2) as u8; 3], "rank {rank}");
        assert_eq!(backwards, vec![(3 - rank) as u8; 3], "rank {rank}");
    }
    let results = on_ranks(2, |group| group.route(b"x", |rank| rank + 1));
    for result in results {
        let error = result.unwrap_err();
        assert!(
            matches!(
                error,
                CommError::BadRoot { .. } | CommError::PeerGone { .. }
            ),
            "{error}"
        );
    }
}

#[test]
fn max_gives_every_rank_the_largest_value() {
    let results = on_ranks(3, |group| {
        let first = group.max([0, 130, 2][group.rank()])?;
        let second = group.max(0)?;
        Ok((first, second))
    });
    for result in results {
        assert_eq!(result.unwrap(), (130, 0));
    }
}

#[test]
fn a_max_part_that_is_not_four_bytes_is_refused_naming_the_rank() {
    let results = on_ranks(2, |group| {
        if group.rank() == 0 {
            return group.max(0).map(|_| ());
        }
        group.gather(&[1, 2, 3])?;
        group.broadcast(&mut Vec::new())
    });
    let error = results[0].as_ref().unwrap_err().to_string();
    assert!(error.contains("rank 1 sent 3 bytes, not 4"), "{error}");
    assert!(
        results[1].is_err(),
        "rank 1 waited for a broadcast rank 0 never sent"
    );
}

#[test]
fn a_peer_that_calls_another_collective_is_a_mismatch() {
    let results = on_ranks(2, |group| {
        if group.rank() == 0 {
            group.barrier()
        } else {
            group.gather(b"x").map(|_| ())
        }
    });
    match &results[0] {
        Err(CommError::Mismatch { op, other_op, .. }) => {
            assert_eq!((*op, *other_op), ("barrier", "gather"));
        }
        other => panic!("rank 0 gave {other:?}, want a mismatch"),
    }
}

#[test]
fn a_peer_that_leaves_is_reported_gone_not_waited_for() {
    let results = on_ranks(2, |group| {
        if group.rank() == 0 {
            group.set_timeout(Duration::from_secs(30))?;
            let started = Instant::now();
            let result = group.barrier();
            assert!(started.elapsed() < Duration::from_secs(10));
            result
        } else {
            Ok(())
        }
    });
    assert!(
        matches!(results[0], Err(CommError::PeerGone { peer: 1, .. })),
        "{:?}",
        results[0]
    );
}

#[test]
fn a_silent_connection_does_not_hold_up_the_ranks() {
    let (silent, took) = pair_after(raw);
    assert!(
        took < HANDSHAKE_TIMEOUT,
        "the job took {took:?} to form beside a silent connection"
    );
    drop(silent);
}

#[test]
fn a_gibibyte_frame_header_is_dropped_unread_and_the_ranks_still_join() {
    let (sent, took) = pair_after(|port| {
        let mut stream = raw(port);
        // An old-style handshake claiming rank 1, then a gather frame of 1 GiB.
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&2u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.push(Kind::Part as u8);
        bytes.extend_from_slice(&(1u32 << 30).to_le_bytes());
        stream.write_all(&bytes).unwrap();
        stream
    });
    assert!(took < HANDSHAKE_TIMEOUT, "{took:?}");
    drop(sent);
}

#[test]
fn an_impostor_without_the_secret_is_refused_and_cannot_claim_a_rank() {
    let (reply, _) = pair_after(|port| {
        let mut stream = raw(port);
        stream
            .write_all(&hello(2, 1, b"not-the-secret-of-this-job"))
            .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).unwrap();
        reply
    });
    assert_eq!(&reply[..5], &[b'M', b'L', b'I', b'3', REFUSED]);
    let reason = String::from_utf8_lossy(&reply[9..]);
    assert!(reason.contains("MILES_JOB_SECRET"), "{reason}");
}

#[test]
fn a_handshake_announcing_an_oversized_secret_is_dropped() {
    let (sent, took) = pair_after(|port| {
        let mut stream = raw(port);
        let mut bytes = hello(2, 1, b"");
        bytes[12..14].copy_from_slice(&u16::MAX.to_le_bytes());
        stream.write_all(&bytes).unwrap();
        stream
    });
    assert!(took < HANDSHAKE_TIMEOUT, "{took:?}");
    drop(sent);
}

#[test]
fn a_frame_above_what_its_kind_carries_is_refused_before_it_is_read() {
    let job = LocalJob::new();
    let env = job.rank(0, 2);
    let zero = std::thread::spawn(move || {
        let mut group = HostGroup::connect(&env, Duration::from_secs(20))?;
        group.set_timeout(Duration::from_secs(10))?;
        group.gather(b"rank 0")
    });
    let mut rank_1 = raw(job.port());
    rank_1.write_all(&hello(2, 1, SECRET.as_bytes())).unwrap();
    let mut reply = [0u8; 5];
    rank_1.read_exact(&mut reply).unwrap();
    assert_eq!(reply[4], ACCEPTED);
    let mut frame = vec![Kind::Part as u8];
    frame.extend_from_slice(&(1u32 << 30).to_le_bytes());
    rank_1.write_all(&frame).unwrap();
    match zero.join().unwrap() {
        Err(CommError::BadLength { what, .. }) => {
            assert!(what.contains("1073741824 bytes"), "{what}");
        }
        other => panic!("rank 0 gave {other:?}, want a bad length"),
    }
    let results = on_ranks(2, |group| {
        if group.rank() == 1 {
            group.gather(&vec![0u8; MAX_PART + 1]).map(|_| ())
        } else {
            Ok(())
        }
    });
    assert!(
        matches!(&results[1], Err(CommError::BadLength { op: "gather", .. })),
        "{:?}",
        results[1]
    );
}

#[test]
fn a_connection_rank_0_drops_unanswered_is_tried_again() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake_rank_0 = std::thread::spawn(move || {
        drop(listener.accept().unwrap());
        let (mut stream, _) = listener.accept().unwrap();
        let mut head = [0u8; HELLO_HEAD];
        stream.read_exact(&mut head).unwrap();
        let mut secret = vec![0u8; usize::from(u16::from_le_bytes([head[12], head[13]]))];
        stream.read_exact(&mut secret).unwrap();
        stream
            .write_all(&[b'M', b'L', b'I', b'3', ACCEPTED])
            .unwrap();
        secret
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    join_rank_0(&local(1, 2, port), deadline, Duration::from_secs(20)).unwrap();
    assert_eq!(fake_rank_0.join().unwrap(), SECRET.as_bytes());
}

#[test]
fn a_stuck_peer_times_out() {
    /// Set once rank 0's barrier has given up: rank 1 stays connected and silent until then.
    static GAVE_UP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let results = on_ranks(2, |group| {
        group.set_timeout(Duration::from_millis(200))?;
        if group.rank() == 0 {
            let result = group.barrier();
            GAVE_UP.store(true, std::sync::atomic::Ordering::SeqCst);
            result
        } else {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !GAVE_UP.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        }
    });
    assert!(
        matches!(results[0], Err(CommError::Timeout { op: "barrier", .. })),
        "{:?}",
        results[0]
    );
}
