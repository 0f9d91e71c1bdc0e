"""Function tools (shared/agent/function_tools.py): the schema from the signature, the description from the
docstring, the episode passed in, and the functions that cannot be tools refused when decorated."""

from __future__ import annotations

from typing import Literal, Optional

import pytest

from rollstream.shared.agent.tools import Episode, ToolSet, tool
from tests.unit.shared.agent.sample_tools import add, call, echo, pick, run


def test_schema_is_in_openai_function_format():
    assert echo.schema() == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Say the text back.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                           "required": ["text"], "additionalProperties": False},
        },
    }


def test_parameters_with_defaults_are_optional_and_show_the_default():
    params = add.parameters
    assert params["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer", "default": 1}}
    assert params["required"] == ["a"]


def test_literal_list_and_optional_types():
    props = pick.parameters["properties"]
    assert props["colour"] == {"type": "string", "enum": ["red", "green"]}
    assert props["sizes"] == {"type": "array", "items": {"type": "integer"}}
    assert props["note"] == {"type": ["string", "null"], "default": None}
    assert pick.parameters["required"] == ["colour", "sizes"]


def test_more_types():
    @tool
    def f(ratio: float, flag: bool, tags: dict[str, int], anything: dict,
          mode: Optional[Literal[1, 2]],  # noqa: UP045  (typing.Optional is what users write too)
          either: int | str, items: list) -> None:
        """Types."""

    props = f.parameters["properties"]
    assert props["ratio"] == {"type": "number"}
    assert props["flag"] == {"type": "boolean"}
    assert props["tags"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["anything"] == {"type": "object"}
    assert props["mode"] == {"type": ["integer", "null"], "enum": [1, 2, None]}
    assert props["either"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert props["items"] == {"type": "array"}
    assert f.parameters["required"] == list(props)


def test_description_and_argument_docs_come_from_the_docstring():
    @tool(name="search_docs")
    def search(query: str, limit: int = 5) -> list[str]:
        """Search the documentation
        for a phrase.

        Longer explanation the model does not need.

        Args:
            query (str): What to look for;
                exact phrases in quotes.
            limit: How many hits to return.

        Returns:
            The hits.
        """
        return []

    assert search.name == "search_docs"
    assert search.description == "Search the documentation for a phrase."
    props = search.parameters["properties"]
    assert props["query"]["description"] == "What to look for; exact phrases in quotes."
    assert props["limit"] == {"type": "integer", "description": "How many hits to return.", "default": 5}


def test_episode_parameter_is_passed_and_not_in_the_schema():
    @tool
    def whoami(episode: Episode, loud: bool = False) -> str:
        """Name the episode."""
        return episode.episode_id.upper() if loud else episode.episode_id

    assert list(whoami.parameters["properties"]) == ["loud"]
    results = run(ToolSet([whoami]).execute([call("whoami", loud=True)], Episode("ep-7")))
    assert results[0].content == "EP-7"


def test_functions_that_cannot_be_tools_are_refused_when_decorated():
    with pytest.raises(ValueError, match="docstring"):
        tool(lambda x: x)
    with pytest.raises(TypeError, match="'x' has no type annotation"):
        @tool
        def untyped(x) -> str:
            """Untyped."""
    with pytest.raises(TypeError, match="cannot describe"):
        @tool
        def odd(x: set[int]) -> str:
            """Sets are not JSON."""
    with pytest.raises(TypeError, match="args"):
        @tool
        def variadic(*args: int) -> str:
            """Variadic."""
