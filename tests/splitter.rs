//! The streaming splitter gives the same reasoning, answer and tool calls however the generated
//! text is cut into pieces.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use smolchat_text::splitter::{SplitEvent, Splitter, ToolCall};

/// What a whole message split into: concatenated reasoning and answer, and the tool-call events
/// (valid or not) in order.
#[derive(Debug, Default, PartialEq)]
struct Split {
    reasoning: String,
    answer: String,
    calls: Vec<SplitEvent>,
}

fn collect(events: impl IntoIterator<Item = SplitEvent>) -> Split {
    let mut split = Split::default();
    for event in events {
        match event {
            SplitEvent::Reasoning(r) => split.reasoning.push_str(&r),
            SplitEvent::Answer(a) => split.answer.push_str(&a),
            call => split.calls.push(call),
        }
    }
    split
}

fn split_pieces(pieces: &[&str], starts_in_reasoning: bool) -> Split {
    let mut splitter = Splitter::new(starts_in_reasoning);
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(splitter.push(piece));
    }
    events.extend(splitter.finish());
    collect(events)
}

fn call(name: &str, arguments: serde_json::Value) -> SplitEvent {
    SplitEvent::ToolCall(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

struct Case {
    text: &'static str,
    starts_in_reasoning: bool,
    want: Split,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            text: "<think>\nLet me think about 2+2.\n\nIt is 4.\n</think>\n\nThe answer is **4**. 🎉\n",
            starts_in_reasoning: false,
            want: Split {
                reasoning: "Let me think about 2+2.\n\nIt is 4.".into(),
                answer: "The answer is **4**. 🎉\n".into(),
                calls: vec![],
            },
        },
        Case {
            text: "<think>\nI should call the tools.\n</think>\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\", \"fmt\": \"<b>\"}}\n</tool_call>",
            starts_in_reasoning: false,
            want: Split {
                reasoning: "I should call the tools.".into(),
                answer: "Let me check.".into(),
                calls: vec![
                    call("get_weather", json!({"city": "Paris"})),
                    call("get_time", json!({"tz": "Europe/Paris", "fmt": "<b>"})),
                ],
            },
        },
        Case {
            text: "The user greets me 👋.\n</think>\n\nHello! 😀 <the> tag-like text < <th <thinking> </thin> <tool <tool_callx> a<b",
            starts_in_reasoning: true,
            want: Split {
                reasoning: "The user greets me 👋.".into(),
                answer: "Hello! 😀 <the> tag-like text < <th <thinking> </thin> <tool <tool_callx> a<b".into(),
                calls: vec![],
            },
        },
        Case {
            text: "Sure.<tool_call>{\"name\": \"x\", \"arguments\": {oops}}</tool_call> done 🦀 <tool_call>{\"name\": \"y\"}</tool_call>",
            starts_in_reasoning: false,
            want: Split {
                reasoning: String::new(),
                answer: "Sure.done 🦀".into(),
                calls: vec![
                    SplitEvent::InvalidToolCall {
                        raw: "{\"name\": \"x\", \"arguments\": {oops}}".into(),
                        error: String::new(),
                    },
                    call("y", json!({})),
                ],
            },
        },
        Case {
            text: "<think>\nstill thinking 🤔 <tool_call>{\"name\":\"inner\"}</tool_call>\n  ",
            starts_in_reasoning: false,
            want: Split {
                reasoning: "still thinking 🤔 <tool_call>{\"name\":\"inner\"}</tool_call>".into(),
                answer: String::new(),
                calls: vec![],
            },
        },
        Case {
            text: "<tool_call>\n{\"name\": \"a\", \"arguments\": \"{\\\"k\\\": 1}\"}",
            starts_in_reasoning: false,
            want: Split {
                reasoning: String::new(),
                answer: String::new(),
                calls: vec![call("a", json!({"k": 1}))],
            },
        },
        Case {
            text: "ok <tool_call>{\"name\": ",
            starts_in_reasoning: false,
            want: Split {
                reasoning: String::new(),
                answer: "ok".into(),
                calls: vec![SplitEvent::InvalidToolCall {
                    raw: "{\"name\": ".into(),
                    error: String::new(),
                }],
            },
        },
        Case {
            text: "  leading space kept, partial tag at the end <thi",
            starts_in_reasoning: false,
            want: Split {
                reasoning: String::new(),
                answer: "  leading space kept, partial tag at the end <thi".into(),
                calls: vec![],
            },
        },
        Case {
            text: "漢字<think>思考🚀</think>答え🦀<think></think>\n終わり</think>",
            starts_in_reasoning: false,
            want: Split {
                reasoning: "思考🚀".into(),
                answer: "漢字答え🦀終わり</think>".into(),
                calls: vec![],
            },
        },
    ]
}

/// Error texts are diagnostics, not contract: compare invalid calls by their raw body only.
fn normalized(mut split: Split) -> Split {
    for event in &mut split.calls {
        if let SplitEvent::InvalidToolCall { error, .. } = event {
            assert!(!error.is_empty(), "an invalid call carries its error");
            error.clear();
        }
    }
    split
}

fn boundaries(text: &str) -> Vec<usize> {
    (0..=text.len())
        .filter(|i| text.is_char_boundary(*i))
        .collect()
}

fn pieces_at<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for &cut in cuts {
        pieces.push(&text[start..cut]);
        start = cut;
    }
    pieces.push(&text[start..]);
    pieces
}

#[test]
fn whole_text_splits_as_documented() {
    for case in cases() {
        let got = normalized(split_pieces(&[case.text], case.starts_in_reasoning));
        assert_eq!(got, case.want, "text {:?}", case.text);
    }
}

#[test]
fn every_single_cut_gives_the_same_split() {
    for case in cases() {
        let whole = split_pieces(&[case.text], case.starts_in_reasoning);
        for cut in boundaries(case.text) {
            let got = split_pieces(&pieces_at(case.text, &[cut]), case.starts_in_reasoning);
            assert_eq!(got, whole, "text {:?} cut at {cut}", case.text);
        }
    }
}

#[test]
fn char_by_char_gives_the_same_split() {
    for case in cases() {
        let whole = split_pieces(&[case.text], case.starts_in_reasoning);
        let cuts = boundaries(case.text);
        let inner = &cuts[1..cuts.len() - 1];
        let got = split_pieces(&pieces_at(case.text, inner), case.starts_in_reasoning);
        assert_eq!(got, whole, "text {:?} char by char", case.text);
    }
}

#[test]
fn random_multi_cuts_give_the_same_split() {
    let mut rng = StdRng::seed_from_u64(0x5eed_cafe);
    for case in cases() {
        let whole = split_pieces(&[case.text], case.starts_in_reasoning);
        let all = boundaries(case.text);
        for _ in 0..300 {
            let n = rng.random_range(1..=8);
            let mut cuts: Vec<usize> = (0..n)
                .map(|_| all[rng.random_range(0..all.len())])
                .collect();
            // Repeated cuts feed empty pieces, which must be harmless too.
            cuts.sort_unstable();
            let got = split_pieces(&pieces_at(case.text, &cuts), case.starts_in_reasoning);
            assert_eq!(got, whole, "text {:?} cuts {cuts:?}", case.text);
        }
    }
}

#[test]
fn split_tags_are_recognised_and_false_starts_released_early() {
    let mut s = Splitter::new(false);
    assert_eq!(s.push("Hi <thi"), vec![SplitEvent::Answer("Hi".into())]);
    assert_eq!(
        s.push("nk>\nhmm"),
        vec![SplitEvent::Reasoning("hmm".into())]
    );
    assert_eq!(s.push("</th"), vec![]);
    assert_eq!(s.push("ink>So <th"), vec![SplitEvent::Answer("So".into())]);
    // `<th` + `e` can no longer become a tag: released at once, with the held space.
    assert_eq!(s.push("e"), vec![SplitEvent::Answer(" <the".into())]);
    assert_eq!(s.push(" end"), vec![SplitEvent::Answer(" end".into())]);
    assert_eq!(s.finish(), vec![]);
}

#[test]
fn finish_resets_for_the_next_message() {
    let mut s = Splitter::new(true);
    let first = collect(s.push("a</think>b").into_iter().chain(s.finish()));
    let second = collect(s.push("a</think>b").into_iter().chain(s.finish()));
    assert_eq!(first, second);
    assert_eq!(first.reasoning, "a");
    assert_eq!(first.answer, "b");
}
