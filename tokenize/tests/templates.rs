//! Real models' chat templates (copied from their tokenizer_config.json) render as
//! transformers renders them.

use kvr_tokenize::{ChatMessage, ChatTemplate};

/// Meta-Llama-3-8B-Instruct's template.
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Qwen2.5-Instruct's template (tools and tool calls included: they use `tojson`,
/// `is defined`, whitespace control and look-behind on `messages`).
const QWEN25: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

/// The date header of Llama-3.1-style templates, and Python string methods.
const DATED: &str = "{%- set date_string = strftime_now(\"%d %b %Y\") %}Today Date: {{ date_string }}\n{% for m in messages %}{% if m.content.startswith('/') %}CMD {% endif %}[{{ m.content.strip() | upper }}]{% endfor %}";

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

#[test]
fn llama3() {
    let t = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>"), Some("<|eot_id|>")).unwrap();
    let text = t
        .render(&msgs(&[("system", "Be brief. "), ("user", "Hi")]))
        .unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn qwen25() {
    let t = ChatTemplate::new(QWEN25, None, Some("<|im_end|>")).unwrap();
    assert_eq!(
        t.render(&msgs(&[("user", "Hi")])).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&msgs(&[
            ("system", "S"),
            ("user", "U"),
            ("assistant", "A"),
            ("user", "V")
        ]))
        .unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n\
         <|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nV<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn strftime_now_and_python_methods() {
    let t = ChatTemplate::new(DATED, None, None).unwrap();
    let text = t
        .render(&msgs(&[("user", "/help "), ("user", " hi")]))
        .unwrap();
    let (date, rest) = text.split_once('\n').unwrap();
    assert_eq!(rest, "CMD [/HELP][HI]");
    let date = date.strip_prefix("Today Date: ").unwrap();
    let parts: Vec<&str> = date.split(' ').collect();
    assert_eq!(parts.len(), 3, "{date}");
    assert!(parts[0].len() == 2 && parts[0].parse::<u32>().is_ok_and(|d| (1..=31).contains(&d)));
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    assert!(months.contains(&parts[1]), "{date}");
    assert!(parts[2].parse::<u32>().is_ok_and(|y| y >= 2025), "{date}");
}

#[test]
fn none_content_is_none_in_templates() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}={{ m.content if m.content is not none else '-' }};{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let m = [
        ChatMessage::new("user", "q"),
        ChatMessage {
            role: "assistant".into(),
            content: None,
        },
    ];
    assert_eq!(t.render(&m).unwrap(), "user=q;assistant=-;");
}

#[test]
fn unsupported_generation_tag_fails_at_load() {
    // transformers' assistant-mask extension; documented as unsupported.
    let e = ChatTemplate::new("{% generation %}x{% endgeneration %}", None, None).unwrap_err();
    assert!(matches!(e, kvr_tokenize::ChatError::BadTemplate(_)), "{e}");
}

#[test]
fn tojson_is_compact() {
    // The documented difference from transformers' `json.dumps` (which would write
    // `{"b": 1, "a": [1, 2]}`).
    let t = ChatTemplate::new("{{ {'b': 1, 'a': [1, 2]} | tojson }}", None, None).unwrap();
    assert_eq!(t.render(&[]).unwrap(), r#"{"a":[1,2],"b":1}"#);
}
