"""Chat rendering against transformers' apply_chat_template with each family's real Jinja template (copied
from the models' tokenizer_config.json files): identical text, identical ids, the same refusals; family
recognition, forcing by name, and the error for an unknown template."""
import json

import pytest
from conftest import tool
from transformers import AutoTokenizer

from test_tokenizer_support import TokCli, build_family

# ---- the real templates ----------------------------------------------------------------------------------

QWEN2 = r"""{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

# Plain ChatML (teknium/OpenHermes-2.5-Mistral-7B): no default system prompt.
CHATML = r"""{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

QWEN25 = r"""{%- if tools %}
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
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
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
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3 = r"""{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

# The first Meta-Llama-3-8B-Instruct upload appended the assistant header unconditionally.
LLAMA3_EARLY = r"""{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"""

_LLAMA31_TAIL = r"""
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
"""

_LLAMA3X_BODY = r"""{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Llama 3.1 (builtin tools variant of the system block) and Llama 3.2 (date from strftime_now).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}""" + _LLAMA31_TAIL + r"""
{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
""" + _LLAMA3X_BODY

LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}""" + _LLAMA31_TAIL + r"""
{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
""" + _LLAMA3X_BODY

LLAMA2 = r"""{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"""

MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

MIXTRAL_V01 = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

MISTRAL_V01 = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""

# HuggingFaceH4/zephyr-7b-beta and TinyLlama/TinyLlama-1.1B-Chat-v1.0.
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")

# (template, family tandem must recognise, tokenizer family, bos, eos)
CASES = {
    "chatml": (CHATML, "chatml", "qwen2", None, "<|im_end|>"),
    "qwen2": (QWEN2, "chatml", "qwen2", None, "<|im_end|>"),
    "qwen2.5": (QWEN25, "chatml", "qwen2", None, "<|im_end|>"),
    "qwen3": (QWEN3, "qwen3", "qwen2", None, "<|im_end|>"),
    "llama3": (LLAMA3, "llama3", "llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3-early": (LLAMA3_EARLY, "llama3", "llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.1": (LLAMA31, "llama3.1", "llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": (LLAMA32, "llama3.1", "llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "llama2": (LLAMA2, "llama2", "llama2", "<s>", "</s>"),
    "mistral-v0.3": (MISTRAL_V03, "mistral", "llama2", "<s>", "</s>"),
    "mixtral-v0.1": (MIXTRAL_V01, "mistral-v1", "llama2", "<s>", "</s>"),
    "mistral-v0.1": (MISTRAL_V01, "mistral-v1", "llama2", "<s>", "</s>"),
    "zephyr": (ZEPHYR, "zephyr", "llama2", "<s>", "</s>"),
}

S, U, A = "system", "user", "assistant"


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [m(U, "Hello!")],
    [m(S, "You are terse."), m(U, "What is 2+2?")],
    [m(S, "Be kind."), m(U, "Hi"), m(A, "Hello, how can I help?"), m(U, "Tell me a joke.")],
    [m(U, "first"), m(A, "second"), m(U, "third"), m(A, "fourth")],
    [m(S, "  padded system \n"), m(U, "\u3000 unicode spaces\u00a0\x1c "), m(A, "  answer with spaces  "), m(U, "")],
    [m(U, "日本語 and emoji 👩‍👩‍👧 and <|im_start|> inside text"), m(A, "ok\n\n")],
    [m(S, "")] + [m(U, "q")],
    # Qwen3 reasoning traces: stripped from history, kept after the last user turn.
    [m(U, "Solve it"), m(A, "<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.")],
    [m(U, "a"), m(A, "<think>old reasoning</think>old answer"), m(U, "b"), m(A, "plain answer")],
    [m(U, "a"), m(A, "x</think>y</think>\n\nz"), m(U, "<tool_response>r</tool_response>"), m(A, "<think>\n\nr2\n</think>done")],
]


@pytest.fixture(scope="module")
def exe():
    return tool("tok_cli")


def build_folders(tmp_path_factory, names):
    """One model folder per case of names: a trained tokenizer (one per family) plus tokenizer_config.json with the
    real template."""
    built = {}
    tok_dirs = {}
    for name in names:
        template, _, tok_family, bos, eos = CASES[name]
        if tok_family not in tok_dirs:
            d = tmp_path_factory.mktemp(f"tok_{tok_family}")
            build_family(tok_family, d)
            tok_dirs[tok_family] = d
        d = tmp_path_factory.mktemp(name)
        (d / "tokenizer.json").write_text((tok_dirs[tok_family] / "tokenizer.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "chat_template": template}))
        built[name] = d
    return built


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build_folders(tmp_path_factory, CASES)


def hf_render(auto, conv, gen, **kw):
    try:
        return auto.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kw), None
    except Exception as e:   # jinja2 raise_exception -> TemplateError
        return None, str(e)


def call(name, args):
    """An assistant tool call as vLLM hands it to the template: arguments parsed from OpenAI's JSON string."""
    return {"type": "function", "function": {"name": name, "arguments": args}}


T = "tool"
# Tool results and assistant tool calls (arguments with nesting, unicode, escapes, reals and integers).
TOOL_CONVERSATIONS = [
    [m(U, "Weather in Paris?"),
     {"role": A, "content": None, "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
     m(T, "{\"temp\": 21.5}"), m(A, "It is 21.5 C.")],
    [m(S, "Use tools."), m(U, "Two lookups"),
     {"role": A, "content": "Calling both.", "tool_calls": [
         call("lookup", {"q": "café \"quoted\"\n", "n": 3, "x": 0.1, "big": 1e16, "small": 1e-05,
                         "deep": {"a": [1, 2.0, True, None]}}),
         call("noop", {})]},
     m(T, "first result"), m(T, "second result"), m(U, "thanks")],
    [m(U, "go"), {"role": A, "content": "", "tool_calls": [call("f", {"k": "v"})]}, m(T, "done")],
]
TOOL_FAMILIES = {"chatml", "qwen3", "llama3"}   # tandem family names (CASES[case][1])


@pytest.mark.parametrize("case", list(CASES))
def test_tool_messages_equal_apply_chat_template(folders, exe, case):
    """Tool results and tool calls render as transformers renders the real template (arguments as the dicts vLLM
    parses them into); families whose tool format tandem does not render refuse with a message that says so."""
    import copy
    d = folders[case]
    auto = AutoTokenizer.from_pretrained(str(d))
    cli = TokCli(exe, d)
    for conv in TOOL_CONVERSATIONS:
        wire = copy.deepcopy(conv)   # what the OpenAI client sends: arguments as JSON text, content null allowed
        for msg in wire:
            for c in msg.get("tool_calls", []):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        for gen in (False, True):
            got = cli.ask(op="chat", messages=wire, add_generation_prompt=gen)
            if CASES[case][1] not in TOOL_FAMILIES:
                assert "does not render tool" in got.get("error", ""), (case, got)
                continue
            hf_conv = [dict(msg, content=msg["content"] or "") for msg in conv]
            want, hf_err = hf_render(auto, hf_conv, gen)
            assert hf_err is None, hf_err
            assert got.get("text") == want, f"{case} gen={gen} conv={conv}"
    cli.close()


@pytest.mark.parametrize("case", list(CASES))
def test_render_equals_apply_chat_template(folders, exe, case):
    d = folders[case]
    auto = AutoTokenizer.from_pretrained(str(d))
    cli = TokCli(exe, d)
    assert cli.ask(op="info")["chat_family"] == CASES[case][1]
    extra_kwargs = [{}]
    if case == "qwen3":
        extra_kwargs = [{}, {"enable_thinking": False}, {"enable_thinking": True}]
    if case.startswith("llama3."):
        extra_kwargs = [{"date_string": "05 Mar 2025"}] + ([{}] if case == "llama3.1" else [])
    checked = 0
    for conv in CONVERSATIONS:
        for gen in (False, True):
            for kw in extra_kwargs:
                want, hf_err = hf_render(auto, conv, gen, **kw)
                got = cli.ask(op="chat", messages=conv, add_generation_prompt=gen, **kw)
                if hf_err is not None:
                    assert "error" in got, f"{case}: HF raised {hf_err!r} but tandem rendered {got}"
                    assert hf_err in got["error"], (hf_err, got["error"])
                    continue
                assert got.get("text") == want, f"{case} gen={gen} {kw} conv={conv}"
                # Token ids of the rendered prompt: apply_chat_template(tokenize=True) encodes without
                # adding special tokens, which is what tandem's callers do with the rendered text.
                ids = auto.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False, **kw)
                assert cli.ask(op="encode", text=got["text"])["ids"] == list(ids), f"{case} ids"
                checked += 1
    assert checked >= len(CONVERSATIONS)   # most conversations are valid for every family
    cli.close()


def test_llama32_uses_todays_date(folders, exe):
    d = folders["llama3.2"]
    auto = AutoTokenizer.from_pretrained(str(d))
    cli = TokCli(exe, d)
    conv = [m(U, "What day is it?")]
    assert cli.ask(op="chat", messages=conv, add_generation_prompt=True)["text"] == hf_render(auto, conv, True)[0]
    cli.close()


def test_alternation_errors_are_reported(folders, exe):
    for case in ("llama2", "mistral-v0.3", "mixtral-v0.1"):
        cli = TokCli(exe, folders[case])
        got = cli.ask(op="chat", messages=[m(U, "a"), m(U, "b")], add_generation_prompt=True)
        assert "alternate" in got["error"], got
        cli.close()


def test_unknown_template_names_the_override(tmp_path, exe):
    build_family("llama2", tmp_path)
    gemma = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
             "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "chat_template": gemma}))
    cli = TokCli(exe, tmp_path)
    got = cli.ask(op="chat", messages=[m(U, "hi")], add_generation_prompt=True)
    assert "not recognised" in got["error"] and "--chat-template" in got["error"]
    # Forcing a family by name renders it anyway, equal to that family's real template.
    forced = cli.ask(op="chat", messages=[m(U, "hi")], add_generation_prompt=True, template="zephyr")
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert forced["text"] == auto.apply_chat_template([m(U, "hi")], chat_template=ZEPHYR, tokenize=False,
                                                      add_generation_prompt=True)
    assert "--chat-template" in cli.ask(op="chat", messages=[m(U, "hi")], template="no-such-family")["error"]
    cli.close()


def test_missing_template_needs_the_option(tmp_path, exe):
    build_family("qwen2", tmp_path)
    cli = TokCli(exe, tmp_path)
    assert "--chat-template" in cli.ask(op="chat", messages=[m(U, "hi")])["error"]
    cli.close()
    cli = TokCli(exe, tmp_path, "--chat-template", "chatml")
    got = cli.ask(op="chat", messages=[m(U, "hi")], add_generation_prompt=True)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert got["text"] == auto.apply_chat_template([m(U, "hi")], chat_template=CHATML, tokenize=False,
                                                   add_generation_prompt=True)
    cli.close()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city, °C or °F.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "the city's \"name\""},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
# The templates whose `tools` tandem writes: Qwen's <tools> system block, Llama 3.1/3.2's definitions in the first
# user turn, Mistral v0.3's [AVAILABLE_TOOLS] before the last user turn.
TOOL_DEFINITION_CASES = {"qwen2.5", "qwen3", "llama3.1", "llama3.2", "mistral-v0.3"}
# Tool turns after the definitions: rendered by tandem for Qwen only (the others' tool turns are refused, see above).
TOOL_TURN_CASES = {"qwen2.5", "qwen3"}


@pytest.mark.parametrize("case", list(CASES))
def test_tool_definitions_equal_apply_chat_template(folders, exe, case):
    """OpenAI `tools` written into the prompt as transformers renders the real template with tools=..., with and
    without a system message, over several user turns, with tool turns after (Qwen): the same text and the same ids;
    the other templates refuse with a message that says so."""
    d = folders[case]
    auto = AutoTokenizer.from_pretrained(str(d))
    cli = TokCli(exe, d)
    kw = {"date_string": "05 Mar 2025"} if case.startswith("llama3.") else {}
    convs = [[m(U, "Weather in Paris?")], [m(S, "Be brief."), m(U, "  Weather in Paris? ")],
             [m(U, "Hi"), m(A, "Hello."), m(U, "Weather in Paris?")],
             [m(S, "sys"), m(U, "same"), m(A, "x"), m(U, "same")],   # Mistral: both equal user turns get the tools
             TOOL_CONVERSATIONS[0]]
    checked = 0
    for conv in convs:
        wire = json.loads(json.dumps(conv))
        for msg in wire:
            for c in msg.get("tool_calls", []):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        has_tool_turns = any(msg["role"] == T or msg.get("tool_calls") for msg in conv)
        for gen in (False, True):
            got = cli.ask(op="chat", messages=wire, add_generation_prompt=gen, tools=TOOLS, **kw)
            if case not in TOOL_DEFINITION_CASES or (has_tool_turns and case not in TOOL_TURN_CASES):
                assert "tool definitions into the prompt" in got.get("error", "") or \
                    "does not render tool" in got.get("error", ""), (case, got)
                continue
            hf_conv = [dict(msg, content=msg["content"] or "") for msg in conv]
            want, hf_err = hf_render(auto, hf_conv, gen, tools=TOOLS, **kw)
            assert hf_err is None, hf_err
            assert got.get("text") == want, f"{case} gen={gen}\n{got}\n---\n{want}"
            ids = auto.apply_chat_template(hf_conv, tools=TOOLS, tokenize=True, add_generation_prompt=gen,
                                           return_dict=False, **kw)
            assert cli.ask(op="encode", text=got["text"])["ids"] == list(ids), f"{case} ids"
            checked += 1
    assert checked >= (8 if case in TOOL_DEFINITION_CASES else 0)
    cli.close()


def test_llama31_tools_need_a_first_user_message(folders, exe):
    """Llama 3.1 puts the definitions in the first user turn: a conversation of only a system message is refused
    with the template's own message."""
    d = folders["llama3.1"]
    auto = AutoTokenizer.from_pretrained(str(d))
    cli = TokCli(exe, d)
    _, hf_err = hf_render(auto, [m(S, "only")], True, tools=TOOLS)
    got = cli.ask(op="chat", messages=[m(S, "only")], add_generation_prompt=True, tools=TOOLS)
    assert hf_err and hf_err in got["error"], (hf_err, got)
    cli.close()
