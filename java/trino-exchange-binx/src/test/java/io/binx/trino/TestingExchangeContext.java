package io.binx.trino;

import io.opentelemetry.api.trace.Span;
import io.trino.spi.QueryId;
import io.trino.spi.exchange.ExchangeContext;
import io.trino.spi.exchange.ExchangeId;

/** The context the engine gives an exchange: a query id (part of binx task ids) and no tracing. */
record TestingExchangeContext(QueryId queryId, ExchangeId exchangeId) implements ExchangeContext {
    TestingExchangeContext(String queryId, ExchangeId exchangeId) {
        this(new QueryId(queryId), exchangeId);
    }

    @Override
    public QueryId getQueryId() {
        return queryId;
    }

    @Override
    public ExchangeId getExchangeId() {
        return exchangeId;
    }

    @Override
    public Span getParentSpan() {
        return Span.getInvalid();
    }
}
