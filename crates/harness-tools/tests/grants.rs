//! A session's filesystem grants: absolute paths under a granted directory resolve there,
//! confined to it like the root is; relative paths stay relative to the root; a grant that is
//! not stamped (revoked) reaches nothing; a grant that is or holds a protected path is left out.

mod support;

use std::os::unix::fs::symlink;

use serde_json::json;
use support::*;

#[tokio::test]
async fn a_granted_directory_outside_the_root_is_reachable_and_confined() {
    let rig = Rig::new();
    let root = rig.root();
    let outside = rig.outside();
    let shared = outside.join("shared");
    std::fs::create_dir_all(shared.join("docs")).unwrap();
    std::fs::write(shared.join("docs/note.txt"), "granted text\n").unwrap();
    std::fs::write(root.join("note.txt"), "root text\n").unwrap();
    let grants = vec![shared.clone()];
    let note = shared.join("docs/note.txt").display().to_string();

    // Read, list, search, write and edit under the grant, by absolute path.
    let r = rig
        .ok_granted("fs::read", json!({"path": note}), &grants)
        .await;
    assert_eq!(text(&r), "granted text\n");
    assert_eq!(r["path"], note, "shown as the absolute path it has");
    let l = rig
        .ok_granted(
            "fs::list",
            json!({"path": shared.join("docs").display().to_string()}),
            &grants,
        )
        .await;
    assert!(l.to_string().contains("note.txt"), "{l}");
    let s = rig
        .ok_granted(
            "fs::search",
            json!({"pattern": "granted", "path": shared.display().to_string()}),
            &grants,
        )
        .await;
    assert_eq!(s["matches"][0]["path"], note, "{s}");
    let made = shared.join("new/deep.txt");
    rig.ok_granted(
        "fs::write",
        json!({"path": made.display().to_string(), "content": "made", "create_dirs": true}),
        &grants,
    )
    .await;
    assert_eq!(std::fs::read_to_string(&made).unwrap(), "made");
    rig.ok_granted(
        "fs::edit",
        json!({"path": note, "old": "granted", "new": "edited"}),
        &grants,
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(shared.join("docs/note.txt")).unwrap(),
        "edited text\n"
    );

    // A relative path is still relative to the root, never to a grant.
    let r = rig
        .ok_granted("fs::read", json!({"path": "note.txt"}), &grants)
        .await;
    assert_eq!(text(&r), "root text\n");
    let e = rig
        .call_granted("fs::read", json!({"path": "docs/note.txt"}), &grants)
        .await
        .unwrap_err();
    assert_eq!(e.code, "tools/not_found", "{e}");

    // Traversal and links out of the grant are refused like out of the root.
    symlink(outside.join("secret.txt"), shared.join("leak")).unwrap();
    symlink(&outside, shared.join("up")).unwrap();
    for path in [
        format!("{}/../secret.txt", shared.display()),
        format!("{}/docs/../../secret.txt", shared.display()),
        format!("{}/leak", shared.display()),
        format!("{}/up/secret.txt", shared.display()),
        outside.join("secret.txt").display().to_string(),
    ] {
        let e = rig
            .call_granted("fs::read", json!({"path": path}), &grants)
            .await
            .unwrap_err();
        assert_eq!(e.code, "tools/outside_root", "{path}: {e}");
        assert!(!e.message.contains("TOP SECRET"));
    }
    let e = rig
        .call_granted(
            "fs::write",
            json!({"path": format!("{}/../escape.txt", shared.display()), "content": "x"}),
            &grants,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, "tools/outside_root", "{e}");
    assert!(!outside.join("escape.txt").exists());

    // Without the grant (revoked: the loop stamps none) the same path is outside.
    let e = rig.err("fs::read", json!({"path": note})).await;
    assert_eq!(e.code, "tools/outside_root", "{e}");
}

#[tokio::test]
async fn a_grant_that_holds_a_protected_path_or_is_gone_is_left_out() {
    let rig = Rig::with_limits(harness_tools::Limits::default(), |dir| {
        vec![dir.join("outside/data")]
    });
    let outside = rig.outside();
    std::fs::create_dir_all(outside.join("data")).unwrap();
    let secret = outside.join("secret.txt").display().to_string();
    for grants in [
        vec![outside.clone()],
        vec![outside.join("data")],
        vec![outside.join("gone")],
        vec!["relative".into()],
    ] {
        let e = rig
            .call_granted("fs::read", json!({"path": secret}), &grants)
            .await
            .unwrap_err();
        assert_eq!(e.code, "tools/outside_root", "{grants:?}: {e}");
    }
}
