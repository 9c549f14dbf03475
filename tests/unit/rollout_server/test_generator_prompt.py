"""A prompt group's messages reach the chat template whole: `name` and `tool_call_id` included."""

from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.services.config import RolloutSection
from rlmesh.v1 import common_pb2

# Renders every field a message may carry, so that a dropped one shows in the ids.
TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.name %}[{{ m.name }}]{% endif %}"
            "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_prompt_ids_keep_name_and_tool_call_id():
    generator = VLLMGenerator("unused", RolloutSection(), seed=0, weight_backend="gloo")
    generator.tokenizer = build_tokenizer("bytes")
    generator.tokenizer.chat_template = TEMPLATE
    group = common_pb2.PromptGroup(group_id="g", messages=[
        common_pb2.ChatMessage(role="user", content="What is 2 + 3?"),
        common_pb2.ChatMessage(role="tool", content="5", name="add", tool_call_id="call_1"),
    ])
    text = generator.tokenizer.decode(generator.prompt_token_ids(group))
    assert text == "user: What is 2 + 3?\ntool[add]#call_1: 5\nassistant:"
