//! The layered system prompt: identity, agent profiles, skills, stickiness and the cache seam,
//! asserted on what the (scripted) router received.

mod support;

use std::path::Path;

use harness_directory::Directory;
use harness_types::api::{SendOptions, SendRequest, SpawnRequest, SystemPromptStrategy};
use serde_json::{json, Value};
use support::*;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// A directory with a two-level profile, two skills and an identity of its own.
fn directory() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    write(
        root,
        "system-prompts/default.md",
        "You are the house identity.",
    );
    write(
        root,
        "agents/base.md",
        "---\nmodel: m\nprovider: scripted\nfunctions: [test::echo]\n---\nBase doctrine.",
    );
    write(
        root,
        "agents/reviewer.md",
        "---\nname: reviewer\ndescription: reviews\nextends: base\nreasoning_effort: high\nskills: [style, ghost]\ndisplay: {name: Rev, icon: review, color: teal}\n---\nReview carefully.",
    );
    write(
        root,
        "skills/style/SKILL.md",
        "---\nname: style\ndescription: House style rules.\n---\nUse short sentences.",
    );
    write(
        root,
        "skills/tests/SKILL.md",
        "---\nname: tests\ndescription: How to test.\n---\nTest behaviour, not lines.",
    );
    write(root, "agents/a.md", "---\nextends: b\n---\nA");
    write(root, "agents/b.md", "---\nextends: a\n---\nB");
    t
}

async fn runtime_with_directory(gens: Value, root: &Path) -> Rt {
    let rt = runtime(json!({ "generations": gens }), config()).await;
    harness_directory::register(&rt.bus, &Directory::new(root));
    rt.register(
        "test::echo",
        Some(json!({"type": "object", "properties": {"text": {"type": "string"}}})),
        |p| p,
    );
    rt
}

fn with_options(mut req: SendRequest, options: SendOptions) -> SendRequest {
    req.options = Some(options);
    req
}

fn agent_send(message: &str, agent: &str) -> SendRequest {
    SendRequest {
        message: json!(message),
        options: Some(SendOptions {
            agent: Some(agent.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn run(rt: &Rt, req: SendRequest) -> String {
    let (r, _) = rt.run(req).await;
    r.session_id
}

/// The requests the router received for a session, with their extras.
fn received(
    rt: &Rt,
    session_id: &str,
) -> Vec<(
    harness_types::router::ChatRequest,
    harness_router::ChatExtras,
)> {
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let extras = rt.recorder.extras.lock().unwrap().clone();
    seen.into_iter()
        .zip(extras)
        .filter(|(r, _)| r.session_id.as_deref() == Some(session_id))
        .collect()
}

/// The test directory and a runtime reading it whose model answers "ok".
async fn ok_runtime() -> (tempfile::TempDir, Rt) {
    let dir = directory();
    let rt = runtime_with_directory(json!([text_gen("ok")]), dir.path()).await;
    (dir, rt)
}

/// A send of `text` naming its own system prompt.
fn prompted(text: &str, prompt: &str) -> SendRequest {
    let options = SendOptions {
        system_prompt: Some(prompt.into()),
        ..Default::default()
    };
    with_options(send(text), options)
}

/// [`run`] of `req` as a later send of session `sid`.
async fn run_in(rt: &Rt, sid: &str, mut req: SendRequest) {
    req.session_id = Some(sid.into());
    run(rt, req).await;
}

#[tokio::test]
async fn two_sessions_on_one_profile_send_byte_identical_stable_prefixes() {
    let (_dir, rt) = ok_runtime().await;
    let s1 = run(&rt, agent_send("first", "reviewer")).await;
    let s2 = run(&rt, agent_send("second", "reviewer")).await;
    let (r1, x1) = received(&rt, &s1).remove(0);
    let (r2, x2) = received(&rt, &s2).remove(0);

    let sections1 = x1.system_sections.unwrap();
    let sections2 = x2.system_sections.unwrap();
    assert!(sections1[0].cache_boundary && !sections1[1].cache_boundary);
    assert_eq!(
        sections1[0].text, sections2[0].text,
        "byte-identical stable prefix"
    );
    assert_ne!(
        sections1[1].text, sections2[1].text,
        "the tails name their sessions"
    );
    let digest1 = x1.cache_intent.unwrap().surface_digest.unwrap();
    assert_eq!(digest1, x2.cache_intent.unwrap().surface_digest.unwrap());
    assert_eq!(
        digest1,
        format!(
            "sha256:{}",
            harness_types::digest::sha256_hex(sections1[0].text.as_bytes())
        )
    );
    // The flat prompt and the sections agree byte for byte.
    let flat = r1.system_prompt.clone().unwrap();
    assert_eq!(
        flat,
        format!("{}\n\n{}", sections1[0].text, sections1[1].text)
    );
    assert!(sections1[1]
        .text
        .contains(&format!("Your session id is {s1}.")));

    // The profile is the whole identity: the chain root first, then its preloaded blocks and
    // the skills index; nothing built-in underneath.
    let stable = &sections1[0].text;
    assert!(
        stable.starts_with("Base doctrine.\n\nReview carefully.\n\n<preloaded_functions>"),
        "{stable}"
    );
    assert!(!stable.contains("house identity") && !stable.contains("inside harness"));
    assert!(
        stable.contains("<function id=\"test::echo\">\ntest function\nRequest schema: {\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\"}}}"),
        "{stable}"
    );
    let preloaded = stable.find("<preloaded_skills>").unwrap();
    assert!(stable.find("<preloaded_functions>").unwrap() < preloaded);
    assert!(stable.contains("<skill name=\"style\">\nUse short sentences.\n</skill>"));
    assert!(stable.contains("Unavailable skills: ghost"), "{stable}");
    // A profile never narrows the index: both skills are listed.
    assert!(
        stable.ends_with("- style: House style rules.\n- tests: How to test.\n</skills>"),
        "{stable}"
    );

    // The profile's model and effort, and the configured baseline policy.
    assert_eq!(r1.model, "m");
    assert_eq!(
        r1.thinking_level,
        Some(harness_types::api::ThinkingLevel::High)
    );
    assert_eq!(r2.model, "m");
    let status = rt.status(&s1).await.unwrap();
    assert!(format!("{status:?}").contains("Completed"));
    // The session records what it froze of the profile.
    let meta = rt.ok("session::get", json!({"session_id": s1})).await;
    assert_eq!(meta["meta"]["metadata"]["agent"]["name"], "reviewer");
    assert_eq!(
        meta["meta"]["metadata"]["agent"]["chain"],
        json!(["base", "reviewer"])
    );
    assert_eq!(
        meta["meta"]["metadata"]["agent"]["display"]["icon"],
        "review"
    );
}

#[tokio::test]
async fn a_prompt_is_sticky_across_sends_and_re_resolves_when_a_field_is_named() {
    let (dir, rt) = ok_runtime().await;
    let sid = run(&rt, prompted("one", "Talk like a pirate.")).await;
    // The directory's identity changes after the session froze its prompt.
    write(
        dir.path(),
        "system-prompts/default.md",
        "You are the NEW identity.",
    );
    run_in(&rt, &sid, send("two")).await;
    let third = with_options(
        send("three"),
        SendOptions {
            system_prompt_strategy: Some(SystemPromptStrategy::Enrich),
            ..Default::default()
        },
    );
    run_in(&rt, &sid, third).await;

    let got = received(&rt, &sid);
    assert_eq!(got.len(), 3);
    let p = |i: usize| got[i].0.system_prompt.clone().unwrap();
    assert!(
        p(0).starts_with("You are the house identity.\n\n<skills>"),
        "{}",
        p(0)
    );
    assert!(
        p(0).contains("</skills>\n\nTalk like a pirate.\n\nYour session id is"),
        "{}",
        p(0)
    );
    assert_eq!(
        p(1),
        p(0),
        "an omitted prompt field inherits the frozen prompt verbatim"
    );
    assert!(p(2).starts_with("You are the NEW identity."), "{}", p(2));
    assert!(
        !p(2).contains("pirate"),
        "a bare strategy resets to the default: {}",
        p(2)
    );
    // The enrich text is per session: it sits after the cacheable prefix.
    let stable = &got[0].1.system_sections.as_ref().unwrap()[0].text;
    assert!(stable.ends_with("</skills>"), "{stable}");
}

#[tokio::test]
async fn an_extends_cycle_is_refused_naming_the_chain() {
    let (dir, rt) = ok_runtime().await;
    let err = rt.harness.send(agent_send("hi", "a")).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "harness/invalid_request: options.agent: agents/a.md: extends: cycle a → b → a"
    );
    let err = rt
        .harness
        .send(agent_send("hi", "nobody"))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("options.agent: agent profile 'nobody' is not in the directory"),
        "{err}"
    );
    // Bad front matter names the file and the field.
    write(
        dir.path(),
        "agents/bad.md",
        "---\nreasoning_effort: huge\n---\nX",
    );
    let err = rt.harness.send(agent_send("hi", "bad")).await.unwrap_err();
    assert!(
        err.to_string().starts_with("harness/invalid_request: options.agent: agents/bad.md: reasoning_effort: unknown variant `huge`"),
        "{err}"
    );
    rt.assert_no_sessions().await;
}

#[tokio::test]
async fn a_profile_only_names_a_new_session_and_never_comes_with_prompt_fields() {
    let (_dir, rt) = ok_runtime().await;
    let sid = run(&rt, send("hi")).await;
    let mut again = agent_send("hi", "reviewer");
    again.session_id = Some(sid.clone());
    let err = rt.harness.send(again).await.unwrap_err().to_string();
    assert!(
        err.contains("options.agent: only on a session-creating send"),
        "{err}"
    );
    let mut both = agent_send("hi", "reviewer");
    both.options.as_mut().unwrap().system_prompt = Some("x".into());
    let err = rt.harness.send(both).await.unwrap_err().to_string();
    assert!(
        err.contains("options.agent: cannot be combined with system_prompt"),
        "{err}"
    );

    // A later bare send keeps the profile (sticky with the prompt); a prompt field sheds it.
    let agent_sid = run(&rt, agent_send("one", "reviewer")).await;
    let mut bare = send("two");
    bare.session_id = Some(agent_sid.clone());
    bare.model = None;
    run(&rt, bare).await;
    let got = received(&rt, &agent_sid);
    assert_eq!(got[0].0.system_prompt, got[1].0.system_prompt);
    assert_eq!(got[1].0.model, "m");
}

#[tokio::test]
async fn the_skills_index_lists_what_the_filter_names_and_stays_sticky() {
    let (dir, rt) = ok_runtime().await;
    let req = with_options(
        send("hi"),
        SendOptions {
            skills: Some(vec!["tests".into()]),
            ..Default::default()
        },
    );
    let sid = run(&rt, req).await;
    run_in(&rt, &sid, send("again")).await;
    let reset = with_options(
        send("all"),
        SendOptions {
            skills: Some(vec![]),
            ..Default::default()
        },
    );
    run_in(&rt, &sid, reset).await;
    let got = received(&rt, &sid);
    let p = |i: usize| got[i].0.system_prompt.clone().unwrap();
    assert!(p(0).contains("<skills>") && p(0).contains("- tests: How to test.\n</skills>"));
    assert!(!p(0).contains("- style:"), "{}", p(0));
    assert_eq!(p(1), p(0), "the filter and its index are sticky");
    assert!(
        p(2).contains("- style: House style rules.\n- tests: How to test.\n</skills>"),
        "{}",
        p(2)
    );
    assert!(p(2).starts_with("You are the house identity."));

    let unknown = with_options(
        send("hi"),
        SendOptions {
            skills: Some(vec!["nope".into()]),
            ..Default::default()
        },
    );
    let err = rt.harness.send(unknown).await.unwrap_err().to_string();
    assert!(
        err.contains("options.skills: skill 'nope' is not in the directory"),
        "{err}"
    );

    // The body comes through directory::skills::get; a path never reaches the data dir.
    let body = rt
        .ok("directory::skills::get", json!({"name": "style"}))
        .await;
    assert_eq!(body["body"], "Use short sentences.");
    let err = rt
        .refused("directory::skills::get", json!({"name": "../t.db"}))
        .await;
    assert!(
        err.contains("name: '../t.db' is not an entry name"),
        "{err}"
    );

    let err = rt
        .refused(
            "harness::system-prompt::get",
            json!({"selected_prompt": {"skills": ["nope"]}}),
        )
        .await;
    assert!(
        err.contains("selected_prompt.skills: skill 'nope'"),
        "{err}"
    );

    // A malformed skill file stops new sessions with the file and field named, as the
    // directory's fault.
    write(
        dir.path(),
        "skills/broken/SKILL.md",
        "---\nname: broken\n---\nno description",
    );
    let err = rt.harness.send(send("hi")).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "harness/dependency: the skills index: skills/broken/SKILL.md: description: missing: the skills index shows it"
    );
}

#[tokio::test]
async fn system_prompt_get_previews_every_layer_and_matches_what_was_sent() {
    let (_dir, rt) = ok_runtime().await;
    let sid = run(&rt, prompted("hi", "Mine.")).await;
    let (sent, extras) = received(&rt, &sid).remove(0);

    let preview = rt
        .ok("harness::system-prompt::get", json!({"session_id": sid}))
        .await;
    let kinds = strings(&preview["layers"], "kind");
    assert_eq!(
        kinds,
        ["frozen", "skills_index", "frozen", "runtime_context"]
    );
    assert_eq!(
        preview["layers"][0]["label"],
        "session (frozen at send): identity"
    );
    assert_eq!(preview["system_prompt"], json!(sent.system_prompt.unwrap()));
    assert_eq!(
        preview["surface_digest"],
        json!(extras.cache_intent.unwrap().surface_digest.unwrap())
    );

    // Selected fields: what a send would freeze, without a model call.
    let before = rt.recorder.seen.lock().unwrap().len();
    let selected = rt
        .ok(
            "harness::system-prompt::get",
            json!({"selected_prompt": {"agent": "reviewer", "skills": ["style"]}}),
        )
        .await;
    assert_eq!(selected["layers"][0]["kind"], "agent");
    assert_eq!(
        selected["layers"][0]["label"],
        "agent profile base → reviewer"
    );
    assert_eq!(selected["layers"][1]["kind"], "skills_index");
    assert_eq!(selected["layers"].as_array().unwrap().len(), 2);
    assert_eq!(selected["stable_prefix"], selected["system_prompt"]);
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        before,
        "no model call"
    );

    let default = rt
        .ok("harness::system-prompt::get", json!({"default_only": true}))
        .await;
    assert_eq!(default["system_prompt"], json!(harness_core::IDENTITY));
    assert_eq!(default["layers"][0]["kind"], "built_in");

    let err = rt
        .refused("harness::system-prompt::get", json!({"sesion_id": "x"}))
        .await;
    assert!(err.contains("sesion_id"), "{err}");
}

#[tokio::test]
async fn a_direct_spawn_names_a_profile_for_its_child() {
    let (_dir, rt) = ok_runtime().await;
    let child = rt
        .harness
        .spawn(SpawnRequest {
            agent: Some("reviewer".into()),
            ..spawning("review this")
        })
        .await
        .unwrap();
    rt.wait_terminal(&child.child_session_id, &child.child_turn_id)
        .await;
    let (req, _) = received(&rt, &child.child_session_id).remove(0);
    assert_eq!(req.model, "m", "the profile's model");
    assert!(req
        .system_prompt
        .unwrap()
        .starts_with("Base doctrine.\n\nReview carefully."));

    let err = rt
        .harness
        .spawn(SpawnRequest {
            options: Some(harness_types::api::SpawnOptions {
                system_prompt: Some("x".into()),
                ..Default::default()
            }),
            agent: Some("reviewer".into()),
            ..spawning("t")
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("agent: cannot be combined with system_prompt"),
        "{err}"
    );
}

#[tokio::test]
async fn without_a_directory_the_built_in_identity_and_no_index() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let sid = run(&rt, send("hi")).await;
    let (req, extras) = received(&rt, &sid).remove(0);
    assert!(req
        .system_prompt
        .unwrap()
        .starts_with(harness_core::IDENTITY));
    assert_eq!(
        extras.system_sections.unwrap()[0].text,
        harness_core::IDENTITY
    );
    let err = rt
        .harness
        .send(agent_send("hi", "reviewer"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("options.agent: no directory is running"),
        "{err}"
    );
}

#[tokio::test]
async fn the_shipped_example_profile_and_skill_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/directory");
    let dir = Directory::new(&root);
    let profile = dir.agent("reviewer").unwrap();
    assert_eq!(profile.skills, vec!["review-checklist"]);
    assert!(profile
        .system_prompt
        .starts_with("You are a code reviewer."));
    let skills = dir.skills().unwrap();
    assert_eq!(skills.skills.len(), 1);
    assert_eq!(skills.skills[0].name, "review-checklist");

    // And a session runs under it with the skill inlined and engine contracts preloaded.
    let rt = runtime_with_directory(json!([text_gen("ok")]), &root).await;
    let mut req = agent_send("review", "reviewer");
    req.model = Some("m".into());
    req.provider = Some("scripted".into());
    let sid = run(&rt, req).await;
    let (sent, _) = received(&rt, &sid).remove(0);
    let prompt = sent.system_prompt.unwrap();
    assert!(
        prompt.contains("<function id=\"engine::functions::info\">"),
        "{prompt}"
    );
    assert!(prompt.contains("<skill name=\"review-checklist\">\n# Review checklist"));
    assert_eq!(
        sent.thinking_level,
        Some(harness_types::api::ThinkingLevel::Medium)
    );
}

#[tokio::test]
async fn a_sub_agent_of_a_profiled_turn_runs_under_the_same_profile_unless_its_prompt_sheds_it() {
    let dir = directory();
    let spawn = |matcher: &str, arguments: Value| {
        json!({"match": {"last_user_text": matcher},
               "content": [{"type": "function_call", "id": "s1", "function_id": "harness::spawn", "arguments": arguments}]})
    };
    let rt = runtime_with_directory(
        json!([
            spawn("^delegate", json!({"task": "inherit this"})),
            spawn(
                "^shed",
                json!({"task": "own prompt", "options": {"system_prompt": "Plain child."}})
            ),
            text_gen("done")
        ]),
        dir.path(),
    )
    .await;
    for message in ["delegate", "shed"] {
        let mut req = agent_send(message, "reviewer");
        req.options.as_mut().unwrap().functions = Some(harness_types::api::FunctionPolicy {
            allow: vec!["harness::spawn".into()],
            ..Default::default()
        });
        rt.run(req).await;
    }
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let child_prompt = |task: &str| {
        seen.iter()
            .find(|r| r.messages.first().map(|m| m.text()).as_deref() == Some(task))
            .unwrap_or_else(|| panic!("no request for {task}"))
            .system_prompt
            .clone()
            .unwrap()
    };
    let inherited = child_prompt("inherit this");
    assert!(
        inherited.starts_with("Base doctrine.\n\nReview carefully.\n\n<preloaded_functions>"),
        "{inherited}"
    );
    let shed = child_prompt("own prompt");
    assert!(
        shed.starts_with("You are the house identity.\n\n<skills>"),
        "{shed}"
    );
    assert!(shed.contains("</skills>\n\nPlain child."), "{shed}");
    assert!(!shed.contains("Review carefully."), "{shed}");
}
