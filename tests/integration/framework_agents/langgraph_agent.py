"""LangGraph: a ReAct loop (the model, a tool node, back to the model until it answers without a tool
call), then the final answer asked for in the same conversation; the model is langchain-openai's
ChatOpenAI with the tool bound."""

from __future__ import annotations

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from tests.integration.framework_agents import FINAL_QUESTION


@tool
def lookup(a: int) -> str:
    """Look a number up."""
    return f"result {a}"


def react_then_ask(llm) -> StateGraph:
    def agent(state: MessagesState) -> dict:
        return {"messages": [llm.invoke(state["messages"])]}

    def ask(state: MessagesState) -> dict:
        question = HumanMessage(FINAL_QUESTION)
        return {"messages": [question, llm.invoke([*state["messages"], question])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_node("ask", ask)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: "ask"})
    graph.add_edge("tools", "agent")
    graph.add_edge("ask", END)
    return graph


def solve(prompt: list[dict], metadata: dict) -> dict:
    llm = ChatOpenAI(model="policy", max_retries=0).bind_tools([lookup])
    out = react_then_ask(llm).compile().invoke({"messages": prompt})
    said = [m for m in out["messages"] if m.type == "ai"]
    correct = float(str(int(metadata["answer"])) in str(said[-1].content))
    return {"reward": correct, "components": {"correct": correct, "calls": float(len(said))}}
