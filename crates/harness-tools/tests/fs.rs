//! The filesystem functions, confined to the stamped root: traversal, symlink escapes,
//! absolute paths, the harness's own files, and a file swapped for a symlink while calls run.

mod support;

use std::os::unix::fs::symlink;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use harness_bus::Bus;
use harness_tools::Limits;
use serde_json::json;
use support::*;

#[tokio::test]
async fn reads_lists_writes_edits_and_searches_inside_the_root() {
    let rig = Rig::new();
    let root = rig.root();
    let w = rig
        .ok(
            "fs::write",
            json!({"path": "src/lib.rs", "content": "fn a() {}\nfn b() {}\nfn c() {}\n"}),
        )
        .await;
    assert_eq!(w["created"], true, "{w}");
    assert_eq!(
        std::fs::read_to_string(root.join("src/lib.rs")).unwrap(),
        "fn a() {}\nfn b() {}\nfn c() {}\n"
    );
    let r = rig
        .ok(
            "fs::read",
            json!({"path": "src/lib.rs", "start_line": 2, "end_line": 2}),
        )
        .await;
    assert_eq!(text(&r), "fn b() {}\n");
    assert_eq!(r["end_line"], 2);
    // An absolute path under the root is the same file.
    let abs = root.join("src/lib.rs").display().to_string();
    let r = rig.ok("fs::read", json!({"path": abs})).await;
    assert!(text(&r).starts_with("fn a()"), "{r}");

    let e = rig
        .ok(
            "fs::edit",
            json!({"path": "src/lib.rs", "old": "fn b() {}", "new": "fn bee() {}"}),
        )
        .await;
    assert_eq!(e["replacements"], 1);
    assert!(std::fs::read_to_string(root.join("src/lib.rs"))
        .unwrap()
        .contains("fn bee() {}"));

    let l = rig.ok("fs::list", json!({})).await;
    assert_eq!(l["entries"], json!([{"name": "src", "type": "dir"}]), "{l}");

    std::fs::write(root.join(".gitignore"), "target/\n").unwrap();
    std::fs::create_dir_all(root.join("target")).unwrap();
    std::fs::write(root.join("target/out.rs"), "fn bee() {}\n").unwrap();
    let s = rig.ok("fs::search", json!({"pattern": "fn b\\w+"})).await;
    assert_eq!(
        s["matches"],
        json!([{"path": "src/lib.rs", "line": 2, "text": "fn bee() {}"}]),
        "ignored files are not searched: {s}"
    );
}

#[tokio::test]
async fn edit_refuses_a_missing_or_ambiguous_match_and_says_how_many() {
    let rig = Rig::new();
    std::fs::write(rig.root().join("f.txt"), "x = 1\nx = 1\n").unwrap();
    let e = rig
        .err(
            "fs::edit",
            json!({"path": "f.txt", "old": "x = 1", "new": "x = 2"}),
        )
        .await;
    assert_eq!(e.code, "tools/no_unique_match");
    assert!(e.message.contains("matches 2 times"), "{e}");
    let e = rig
        .err("fs::edit", json!({"path": "f.txt", "old": "y", "new": "z"}))
        .await;
    assert!(e.message.contains("0 matches"), "{e}");
    assert_eq!(
        std::fs::read_to_string(rig.root().join("f.txt")).unwrap(),
        "x = 1\nx = 1\n",
        "unchanged"
    );
    let ok = rig
        .ok(
            "fs::edit",
            json!({"path": "f.txt", "old": "x = 1", "new": "x = 2", "replace_all": true}),
        )
        .await;
    assert_eq!(ok["replacements"], 2);
}

#[tokio::test]
async fn traversal_absolute_paths_and_symlinks_out_of_the_root_are_refused() {
    let rig = Rig::new();
    let root = rig.root();
    let outside = rig.outside();
    symlink(outside.join("secret.txt"), root.join("abs_link")).unwrap();
    symlink("../outside/secret.txt", root.join("rel_link")).unwrap();
    symlink(&outside, root.join("dir_link")).unwrap();
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/ok.txt"), "fine").unwrap();
    // A symlink that stays inside the root is followed.
    symlink("sub/ok.txt", root.join("inner_link")).unwrap();
    assert_eq!(
        text(&rig.ok("fs::read", json!({"path": "inner_link"})).await),
        "fine"
    );
    assert_eq!(
        text(
            &rig.ok("fs::read", json!({"path": "sub/../sub/ok.txt"}))
                .await
        ),
        "fine"
    );

    let secret = outside.join("secret.txt").display().to_string();
    for path in [
        "../outside/secret.txt",
        "sub/../../outside/secret.txt",
        secret.as_str(),
        "/etc/passwd",
        "abs_link",
        "rel_link",
        "dir_link/secret.txt",
    ] {
        let e = rig.err("fs::read", json!({"path": path})).await;
        assert_eq!(e.code, "tools/outside_root", "{path}: {e}");
        assert!(!e.message.contains("TOP SECRET"));
    }
    // Writing, editing, listing and searching the same ways out are refused alike.
    let mut escapes = Vec::new();
    for path in [
        "../outside/new.txt",
        "dir_link/new.txt",
        "abs_link",
        "rel_link",
    ] {
        escapes.push(("fs::write", json!({"path": path, "content": "pwned"})));
    }
    escapes.push((
        "fs::edit",
        json!({"path": "rel_link", "old": "TOP", "new": "X"}),
    ));
    for path in ["..", "dir_link", "/"] {
        escapes.push(("fs::list", json!({"path": path})));
        escapes.push(("fs::search", json!({"pattern": "SECRET", "path": path})));
    }
    for (function_id, args) in escapes {
        let e = rig.err(function_id, args.clone()).await;
        assert_eq!(e.code, "tools/outside_root", "{function_id} {args}: {e}");
    }
    // Searching the root does not follow the links out of it.
    let s = rig.ok("fs::search", json!({"pattern": "SECRET"})).await;
    assert_eq!(s["matches"], json!([]), "{s}");
    assert_eq!(
        std::fs::read_to_string(outside.join("secret.txt")).unwrap(),
        "TOP SECRET\n"
    );
    assert!(!outside.join("new.txt").exists());
}

#[tokio::test]
async fn the_data_directory_and_the_configuration_are_refused_even_under_the_root() {
    let rig = Rig::with_limits(Limits::default(), |dir| {
        vec![
            dir.join("root/.harness-data"),
            dir.join("root/harness.yaml"),
        ]
    });
    let root = rig.root();
    std::fs::create_dir_all(root.join(".harness-data")).unwrap();
    std::fs::write(root.join(".harness-data/harness.db"), "STORE").unwrap();
    std::fs::write(root.join("harness.yaml"), "default_max_turns: 3 # CONFIG\n").unwrap();
    symlink(".harness-data/harness.db", root.join("store_link")).unwrap();
    std::fs::write(root.join("a.txt"), "hello").unwrap();
    for path in [
        ".harness-data/harness.db",
        "harness.yaml",
        "store_link",
        "./sub/../harness.yaml",
    ] {
        let e = rig.err("fs::read", json!({"path": path})).await;
        assert!(
            e.code == "tools/protected_path" || e.code == "tools/not_found",
            "{path}: {e}"
        );
        assert!(!e.message.contains("STORE") && !e.message.contains("CONFIG"));
    }
    let e = rig.err("fs::read", json!({"path": "harness.yaml"})).await;
    assert_eq!(e.code, "tools/protected_path");
    for (f, args) in [
        (
            "fs::write",
            json!({"path": "harness.yaml", "content": "default_max_turns: 99"}),
        ),
        (
            "fs::write",
            json!({"path": ".harness-data/new.db", "content": "x"}),
        ),
        (
            "fs::edit",
            json!({"path": "harness.yaml", "old": "3", "new": "99"}),
        ),
        ("fs::list", json!({"path": ".harness-data"})),
        (
            "fs::search",
            json!({"pattern": ".", "path": ".harness-data"}),
        ),
    ] {
        let e = rig.err(f, args.clone()).await;
        assert_eq!(e.code, "tools/protected_path", "{f} {args}: {e}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join("harness.yaml")).unwrap(),
        "default_max_turns: 3 # CONFIG\n"
    );
    assert!(!root.join(".harness-data/new.db").exists());
    let l = rig.ok("fs::list", json!({})).await;
    let names = strings(&l["entries"], "name");
    assert_eq!(
        names,
        ["a.txt", "store_link"],
        "the harness's own files are not listed"
    );
    let s = rig
        .ok(
            "fs::search",
            json!({"pattern": "STORE|CONFIG", "hidden": true}),
        )
        .await;
    assert_eq!(s["matches"], json!([]), "{s}");
    // A root inside the data directory is refused outright.
    let e = rig
        .bus
        .call(
            "fs::list",
            json!({"fs_scope": {"root": root.join(".harness-data"), "grants": [], "boundary": "workspace"}}),
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, "tools/protected_path", "{e}");
}

#[tokio::test]
async fn without_a_stamped_root_nothing_runs_and_unknown_fields_are_refused() {
    let rig = Rig::new();
    // Every function but `web::fetch`, which reaches no filesystem.
    for f in harness_tools::FUNCTIONS
        .iter()
        .copied()
        .filter(|f| *f != "web::fetch")
    {
        let e = rig
            .bus
            .call(f, json!({"path": "a", "pattern": "a", "content": "", "old": "a", "new": "b", "command": "true"}), None)
            .await
            .unwrap_err();
        // Either the unknown fields or the missing root: never a run.
        assert!(
            e.code == "tools/no_filesystem_root" || e.code == "harness/invalid_request",
            "{f}: {e}"
        );
    }
    let e = rig
        .bus
        .call("fs::read", json!({"path": "a"}), None)
        .await
        .unwrap_err();
    assert_eq!(e.code, "tools/no_filesystem_root", "{e}");
    assert!(e.message.contains("filesystem_root"), "{e}");
    let e = rig
        .err("fs::read", json!({"path": "a", "sudo": true}))
        .await;
    assert_eq!(e.code, "harness/invalid_request");
    assert!(e.message.contains("sudo"), "{e}");
}

#[tokio::test]
async fn reads_are_capped() {
    let limits = Limits {
        read_max_bytes: 1000,
        ..Limits::default()
    };
    let rig = Rig::with_limits(limits, |_| Vec::new());
    let line = "0123456789\n".repeat(200);
    std::fs::write(rig.root().join("big.txt"), &line).unwrap();
    let r = rig.ok("fs::read", json!({"path": "big.txt"})).await;
    assert_eq!(r["truncated"], true);
    assert!(text(&r).len() < 1200, "{}", text(&r).len());
    assert!(text(&r).contains("read on with start_line"), "{}", text(&r));
}

/// The race a check-then-open would lose: a file is swapped for a symlink to a secret outside
/// the root (and back) as fast as possible while reads and writes of that name run. No read
/// may ever return the secret and no write may ever reach the outside file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_swapped_for_a_symlink_between_check_and_use_never_leaks() {
    let rig = Rig::new();
    let root = rig.root();
    let secret = rig.outside().join("secret.txt");
    std::fs::write(root.join("plain"), "PLAIN\n").unwrap();
    std::fs::write(root.join("swap"), "PLAIN\n").unwrap();
    symlink(&secret, root.join("evil")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let stop = stop.clone();
        let swaps = swaps.clone();
        let root = root.clone();
        let secret = secret.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // rename(2) replaces atomically: the name is always one or the other.
                std::fs::write(root.join("tmp_plain"), "PLAIN\n").ok();
                std::fs::rename(root.join("tmp_plain"), root.join("swap")).ok();
                symlink(&secret, root.join("tmp_evil")).ok();
                std::fs::rename(root.join("tmp_evil"), root.join("swap")).ok();
                swaps.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let bus = shared_bus(&rig);
    let stamp = json!({"root": root, "grants": [], "boundary": "workspace"});
    let (mut plain, mut refused, mut i) = (0u64, 0u64, 0u64);
    // Until the race really ran (a loaded machine may starve the swapper for a while) and
    // both of its outcomes were seen, within a deadline.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while (swaps.load(Ordering::Relaxed) < 300 || plain < 20 || refused < 20 || i < 1000)
        && std::time::Instant::now() < deadline
    {
        i += 1;
        let r = bus
            .call("fs::read", json!({"path": "swap", "fs_scope": stamp}), None)
            .await;
        match r {
            Ok(v) => {
                // The name holds what the swapper or this test's own writes (inside the root)
                // put there; never the outside file.
                let got = v["content"][0]["text"].as_str().unwrap_or_default();
                assert!(
                    got == "PLAIN\n" || got == "OVERWRITTEN\n",
                    "read {i} leaked: {v}"
                );
                plain += 1;
            }
            Err(e) => {
                assert!(!e.message.contains("TOP SECRET"), "{e}");
                refused += 1;
            }
        }
        if i % 3 == 0 {
            let _ = bus
                .call(
                    "fs::write",
                    json!({"path": "swap", "content": "OVERWRITTEN\n", "fs_scope": stamp}),
                    None,
                )
                .await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    let swaps = swaps.load(Ordering::Relaxed);
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "TOP SECRET\n",
        "the outside file was never written"
    );
    assert!(swaps >= 300, "the race ran ({swaps} swaps)");
    assert!(
        plain >= 20 && refused >= 20,
        "both sides of the race were seen: {plain} reads, {refused} refusals"
    );
}
